// tide transport: the host side of TIDE-AG and TIDE-RS inside one NVLink domain, and the Python
// bindings of the extension (one Python -> C++ call per op).
//
// Symmetric arena of one TIDE group (same layout on every rank r, peers' copies mapped at bases[p]):
//
//   bases[p] + flags_off                          int32 flag words (FlagLayout below)
//   bases[p] + slots_off + i * slot_bytes         all-gather slot i, i < K; param-major, GroupLayout:
//                                                 param j's output at slot_offset(j), rank q's shard of
//                                                 param j at slot_offset(j) + q * shard_numel(j) * itemsize
//   bases[p] + ring_off + (s * W + q) * E         reduce-scatter staging entry of slot s (< R) that
//                                                 contributor q fills for destination p
//
// TIDE-AG, rank r, slot i, use v (the i-th slot's use count, identical on all ranks):
//   S (caller's stream):  cast own shards into own slot i (the op's only kernel);
//                         post ag_free[i][r] = v into every peer (my slot i may be written);
//   P (push stream):      wait ag_free[i][p] >= v (local words) for all peers p;
//                         copy-engine copies of my pieces to every peer's slot i, same offsets;
//                         post ag_ready[i][r] = v into every peer;
//   S:                    wait ag_ready[i][p] >= v for all peers; wait P.
// TIDE-RS, rank r (In-Place: pieces read from autograd's gradients; Slot-Reuse: from their param-major
// places in a vacated slot, grad j at slot_offset(j), copied there first unless already there), for
// every round j, destinations in a rotation, g = rounds done for d + 1:
//   P:  wait rs_free[d][s] >= g - R (d has reduced what used staging slot s before);
//       copy my round-j pieces for d into d's staging entry (s, r); post rs_ready[s][r] = g into d;
//   Rd (reduce stream), my own round j: wait rs_ready[s][q] >= g for all q != r; summing kernel over
//       the round's segments (own contribution read in place); post rs_free[r][s] = g into every q.
//   All ranks issue in one global (round, destination) order, so no wait cycle can form even if P and
//   Rd were serialised; no kernel ever spins on a flag.
// Flags are sequence numbers that only grow, so nothing is ever reset.
#include <torch/extension.h>

#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <iterator>
#include <list>
#include <map>
#include <memory>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "tide.h"
#include "transport/driver.h"

namespace tide {
namespace {

#define TIDE_CUDA(op, expr)                                                                            \
  do {                                                                                                 \
    const cudaError_t err_ = (expr);                                                                   \
    TORCH_CHECK(err_ == cudaSuccess, "tide." op ": ", #expr, " failed: ", cudaGetErrorString(err_));  \
  } while (0)

int32_t dtype_code(const char* op, at::ScalarType t) {
  switch (t) {
    case at::kFloat: return kF32;
    case at::kBFloat16: return kBF16;
    case at::kHalf: return kF16;
    default: TORCH_CHECK(false, "tide.", op, ": unsupported dtype ", c10::toString(t), " (bf16, fp16 or fp32)");
  }
  return kF32;
}

uint64_t ptr_of(const at::Tensor& t) { return reinterpret_cast<uint64_t>(t.data_ptr()); }

// Int32 flag words of the arena, from flags_off.
struct FlagLayout {
  int64_t K, R, W;
  int64_t ag_free(int64_t slot, int64_t p) const { return slot * W + p; }
  int64_t ag_ready(int64_t slot, int64_t p) const { return K * W + slot * W + p; }
  int64_t rs_ready(int64_t s, int64_t q) const { return 2 * K * W + s * W + q; }
  int64_t rs_free(int64_t d, int64_t s) const { return 2 * K * W + R * W + d * R + s; }
  // Source words of the 4-B flag copies (local; written by stream memops, read by the copies):
  // the push stream's, one per destination d (AG uses d = own rank), and the reduce stream's.
  int64_t src_push(int64_t d) const { return 2 * K * W + 2 * R * W + d; }
  int64_t src_reduce() const { return 2 * K * W + 2 * R * W + W; }
  int64_t words() const { return 2 * K * W + 2 * R * W + W + 4; }
};

// Launches a cast/copy over any number of segments, kMaxSegments per launch.
class CastBatch {
 public:
  CastBatch(int ctas, cudaStream_t stream) : ctas_(ctas), stream_(stream) { args_.nseg = 0; }
  void add(const void* src, void* dst, int64_t n, int32_t src_dtype, int32_t dst_dtype) {
    if (n == 0) return;
    args_.seg[args_.nseg++] = CastSegment{src, dst, n, src_dtype, dst_dtype};
    if (args_.nseg == kMaxSegments) flush();
  }
  void flush() {
    launch_cast_segments(args_, ctas_, stream_);
    launches_ += args_.nseg > 0;
    args_.nseg = 0;
  }
  int launches() const { return launches_; }

 private:
  int ctas_;
  cudaStream_t stream_;
  CastArgs args_;
  int launches_ = 0;
};

}  // namespace

// Placement of one all-gather (one GroupLayout) in a slot, built once per layout (tide/transport/plans.py).
struct AgPlan {
  std::vector<int64_t> own_off;    // bytes from slot start to this rank's shard of param j
  std::vector<int64_t> own_bytes;  // bytes of this rank's shard of param j (shard_numel * itemsize)
  std::vector<int64_t> out_off;    // bytes from slot start to param j's output
  std::vector<int64_t> out_numel;
  std::vector<int32_t> out_dtype;
  int64_t slot_bytes;
  AgPlan(std::vector<int64_t> own_off_, std::vector<int64_t> own_bytes_, std::vector<int64_t> out_off_,
         std::vector<int64_t> out_numel_, std::vector<int64_t> out_dtype_, int64_t slot_bytes_)
      : own_off(std::move(own_off_)), own_bytes(std::move(own_bytes_)), out_off(std::move(out_off_)),
        out_numel(std::move(out_numel_)), slot_bytes(slot_bytes_) {
    for (auto d : out_dtype_) out_dtype.push_back(static_cast<int32_t>(d));
    const size_t n = own_off.size();
    TORCH_CHECK(own_bytes.size() == n && out_off.size() == n && out_numel.size() == n && out_dtype.size() == n,
                "tide.AgPlan: per-param lists differ in length");
  }
  size_t size() const { return own_off.size(); }
};

// One reduce-scatter chunk as the plan stores it (GroupLayout.rs_chunks packed into staging entries).
struct RsChunk {
  int64_t param, grad_off, shard_off, n, entry_off;  // elements, except entry_off (bytes in the entry)
};

struct RsPlan {
  // rounds[d][j]: the chunks reduced into rank d's shard grads in d's j-th round.
  std::vector<std::vector<std::vector<RsChunk>>> rounds;
  std::vector<std::array<int64_t, 3>> pads;  // (param, shard_off, n) of this rank's padding
  std::vector<int32_t> grad_dtype;
  // Slot-Reuse: bytes from a slot's start to param j's gradient, the all-gather output addresses of the
  // same params (param-major GroupLayout), and the bytes the group needs in a slot.
  std::vector<int64_t> slot_off;
  int64_t slot_bytes;
  int64_t max_rounds = 0;

  RsPlan(const std::vector<std::vector<std::vector<int64_t>>>& rounds_flat, std::vector<std::vector<int64_t>> pads_,
         std::vector<int64_t> grad_dtype_, std::vector<int64_t> slot_off_, int64_t slot_bytes_)
      : slot_off(std::move(slot_off_)), slot_bytes(slot_bytes_) {
    for (const auto& per_dest : rounds_flat) {
      std::vector<std::vector<RsChunk>> rs;
      for (const auto& flat : per_dest) {
        TORCH_CHECK(flat.size() % 5 == 0, "tide.RsPlan: a round must be a flat list of 5-tuples");
        std::vector<RsChunk> chunks;
        for (size_t i = 0; i < flat.size(); i += 5)
          chunks.push_back(RsChunk{flat[i], flat[i + 1], flat[i + 2], flat[i + 3], flat[i + 4]});
        rs.push_back(std::move(chunks));
      }
      max_rounds = std::max<int64_t>(max_rounds, static_cast<int64_t>(rs.size()));
      rounds.push_back(std::move(rs));
    }
    for (const auto& p : pads_) {
      TORCH_CHECK(p.size() == 3, "tide.RsPlan: a pad range is (param, shard_off, n)");
      pads.push_back({p[0], p[1], p[2]});
    }
    for (auto d : grad_dtype_) grad_dtype.push_back(static_cast<int32_t>(d));
    TORCH_CHECK(slot_off.size() == grad_dtype.size(), "tide.RsPlan: one slot offset per gradient");
  }
};

// Plan registries are keyed by what a plan depends on, encoded as integers (dtype codes, ranks and
// sizes), so that a call finds its plan without building any Python object.
using PlanKey = std::vector<int64_t>;
struct PlanKeyHash {
  size_t operator()(const PlanKey& k) const {
    uint64_t h = 1469598103934665603ull;
    for (int64_t x : k) h = (h ^ static_cast<uint64_t>(x)) * 1099511628211ull;
    return static_cast<size_t>(h);
  }
};

// How the copy lists of a call are issued (TIDE_CE_MODE): replay of a cached CUDA graph of memcpy
// nodes (default), one cudaMemcpyBatchAsync per run of data copies, or one cudaMemcpyAsync per copy.
enum CeMode : int64_t { kCeGraph = 0, kCeBatch = 1, kCeLoop = 2 };

// Host-time categories of Arena::counters(): nanoseconds spent inside the ops' C++ part, by call kind.
enum HostCat : int { kHTotal = 0, kHKernel, kHMemop, kHGraphLaunch, kHGraphUpdate, kHGraphBuild, kHCopyApi, kHEvent, kHCats };

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

// One copy of a copy list: data (a piece of a slot or of a gradient) or a 4-B flag (a source word
// into a peer's flag word, ordered after the data before it in the list).
struct Copy {
  uint64_t dst, src;
  size_t bytes;
  bool flag;
};

// A copy list instantiated as a chain of memcpy nodes (list order = execution order).
struct CopyGraph {
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  std::vector<cudaGraphNode_t> nodes;
  std::vector<Copy> copies;  // as the nodes currently read/write them
  int64_t data_copies = 0, flag_copies = 0, data_bytes = 0;
};

void destroy_graph(CopyGraph& g) {
  if (g.exec) cudaGraphExecDestroy(g.exec);  // an in-flight launch completes first (freed asynchronously)
  if (g.graph) cudaGraphDestroy(g.graph);
  g.exec = nullptr;
  g.graph = nullptr;
  g.nodes.clear();
}

class Arena {
 public:
  Arena(int64_t rank, int64_t world, std::vector<int64_t> bases, int64_t device, int64_t flags_off,
        int64_t slots_off, int64_t slot_bytes, int64_t num_slots, int64_t ring_off, int64_t entry_bytes,
        int64_t ring_depth, int64_t ctas, int64_t ce_mode, int64_t max_graph_sets)
      : rank_(rank), world_(world), device_(device), flags_off_(flags_off), slots_off_(slots_off),
        slot_bytes_(slot_bytes), ring_off_(ring_off), entry_bytes_(entry_bytes), ctas_(ctas), mode_(ce_mode),
        max_graph_sets_(max_graph_sets), flags_{num_slots, ring_depth, world} {
    TORCH_CHECK(world >= 1 && rank >= 0 && rank < world, "tide.Arena: rank ", num(rank), " not in [0, ", num(world), ")");
    TORCH_CHECK(static_cast<int64_t>(bases.size()) == world, "tide.Arena: need one base pointer per rank");
    TORCH_CHECK(num_slots >= 1 && ring_depth >= 1, "tide.Arena: num_slots and ring_depth must be >= 1");
    TORCH_CHECK(max_graph_sets >= 1, "tide.Arena: max_graph_sets must be >= 1, got ", num(max_graph_sets));
    TORCH_CHECK(entry_bytes % 16 == 0 && slot_bytes % 16 == 0, "tide.Arena: entry_bytes and slot_bytes must be multiples of 16");
    TORCH_CHECK(ce_mode == kCeGraph || ce_mode == kCeBatch || ce_mode == kCeLoop,
                "tide.Arena: ce_mode must be 0 (graph), 1 (batch) or 2 (loop), got ", num(ce_mode));
    TORCH_CHECK(driver::available(), "tide.Arena: the CUDA driver lacks stream memory operations (cuStreamBatchMemOp)");
    for (auto b : bases) bases_.push_back(static_cast<uint64_t>(b));
    ag_uses_.assign(num_slots, 0);
    rs_rounds_.assign(world, 0);
    ag_free_graphs_.resize(num_slots);
    rs_free_graphs_.resize(ring_depth);
    c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
    int lo = 0, hi = 0;
    TIDE_CUDA("Arena", cudaDeviceGetStreamPriorityRange(&lo, &hi));
    TIDE_CUDA("Arena", cudaStreamCreateWithPriority(&push_, cudaStreamNonBlocking, lo));
    // The summing CTAs get the highest priority, so they are scheduled ahead of the model's kernels.
    TIDE_CUDA("Arena", cudaStreamCreateWithPriority(&reduce_, cudaStreamNonBlocking, hi));
    for (auto* e : {&ev_s_, &ev_p_, &ev_r_}) TIDE_CUDA("Arena", cudaEventCreateWithFlags(e, cudaEventDisableTiming));
    // Writes and waits in one cuStreamBatchMemOp, if this driver takes them (a write and a wait on a
    // source word no copy reads yet); otherwise one cuStreamWriteValue32 per write.
    const uint64_t probe = local_flag(flags_.src_reduce());
    batched_writes_ = driver::batch(push_, {driver::MemOp{probe, 0u}}, {driver::MemOp{probe, 0u}}, true) == 0;
    (void)cudaGetLastError();
    TIDE_CUDA("Arena", cudaStreamSynchronize(push_));
  }

  ~Arena() {
    // Streams, events and graphs are left to process teardown when the context is already gone.
    if (cudaSetDevice(static_cast<int>(device_)) != cudaSuccess) return;
    cudaStreamSynchronize(push_);
    cudaStreamSynchronize(reduce_);
    clear_plan_graphs();
    for (auto& g : ag_free_graphs_) destroy_graph(g);
    for (auto& g : rs_free_graphs_) destroy_graph(g);
    cudaEventDestroy(ev_s_);
    cudaEventDestroy(ev_p_);
    cudaEventDestroy(ev_r_);
    cudaStreamDestroy(push_);
    cudaStreamDestroy(reduce_);
  }

  int64_t next_slot() const { return ring_pos_; }
  int64_t num_slots() const { return flags_.K; }
  int64_t flag_words() const { return flags_.words(); }
  int64_t ce_mode() const { return mode_; }
  std::string graph_error() const { return graph_error_; }
  bool batched_writes() const { return batched_writes_; }
  uint64_t slot_base(int64_t rank, int64_t slot) const { return bases_[rank] + slots_off_ + slot * slot_bytes_; }

  // The slot in which outs are bound at plan's param-major addresses, or -1.
  int64_t bound_slot(const AgPlan& plan, const std::vector<at::Tensor>& outs) const {
    if (outs.empty()) return -1;
    for (int64_t i = 0; i < flags_.K; ++i) {
      const uint64_t base = slot_base(rank_, i);
      bool all = true;
      for (size_t j = 0; j < outs.size() && all; ++j)
        all = outs[j].numel() == 0 || ptr_of(outs[j]) == base + static_cast<uint64_t>(plan.out_off[j]);
      if (all) return i;
    }
    return -1;
  }

  // TIDE-AG. Returns the slot used; copies out into `outs` unless they are bound in that slot.
  int64_t all_gather(const std::shared_ptr<AgPlan>& plan_ptr, const std::vector<at::Tensor>& shards,
                     const std::vector<at::Tensor>& outs) {
    static constexpr const char* op = "all_gather_into_params_";
    TORCH_CHECK(plan_ptr != nullptr, "tide.", op, ": no plan");
    const AgPlan& plan = *plan_ptr;
    HostTimer total(host_ns_[kHTotal]);
    ++calls_;
    TORCH_CHECK(shards.size() == plan.size(), "tide.", op, ": ", num(shards.size()), " shards for a plan of ", num(plan.size()));
    TORCH_CHECK(outs.empty() || outs.size() == plan.size(), "tide.", op, ": ", num(outs.size()), " outs for a plan of ", num(plan.size()));
    TORCH_CHECK(plan.slot_bytes <= slot_bytes_, "tide.", op, ": the group needs ", num(plan.slot_bytes),
                " slot bytes but the arena's slots hold ", num(slot_bytes_), " (enable TIDE with a larger slot)");
    c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device_));
    cudaStream_t S = c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device_)).stream();
    check_not_capturing(op, S);
    const int64_t bound = bound_slot(plan, outs);
    const int64_t slot = bound >= 0 ? bound : ring_pos_;
    ring_pos_ = (slot + 1) % flags_.K;
    const uint32_t v = ++ag_uses_[slot];
    const uint64_t mine = slot_base(rank_, slot);

    // 1. The own shard, cast straight into its final place in my slot: the op's only kernel.
    {
      HostTimer t(host_ns_[kHKernel]);  // the segment list and its launches
      CastBatch cast(static_cast<int>(ctas_), S);
      for (size_t j = 0; j < plan.size(); ++j) {
        const at::Tensor& s = shards[j];
        TORCH_CHECK(s.numel() * dtype_size(plan.out_dtype[j]) == plan.own_bytes[j], "tide.", op, ": shards[", num(j),
                    "] has ", num(s.numel()), " elements; the plan expects ", num(plan.own_bytes[j] / dtype_size(plan.out_dtype[j])));
        cast.add(s.data_ptr(), reinterpret_cast<void*>(mine + plan.own_off[j]), s.numel(), dtype_code(op, s.scalar_type()),
                 plan.out_dtype[j]);
      }
      cast.flush();
      kernels_ += cast.launches();
    }
    if (world_ > 1) {
      // 2. Push stream, after the cast: post "my slot is free" (v) into every peer, wait for every
      //    peer's, copy my pieces to the same offsets of their slots, each peer's pieces followed by
      //    its "ready" flag (v, from the same source word).
      join(push_, S, ev_s_);
      const uint64_t src = local_flag(flags_.src_push(rank_));
      memops(push_, {driver::MemOp{src, v}}, {});
      if (!try_graph([&] {
            CopyGraph& fg = ag_free_graphs_[slot];
            if (!fg.exec) build_graph(fg, ag_free_copies(slot));
            launch(fg, push_);
          }))
        issue(ag_free_copies(slot), push_);
      std::vector<driver::MemOp> waits;
      for (int64_t p = 0; p < world_; ++p)
        if (p != rank_) waits.push_back(driver::MemOp{local_flag(flags_.ag_free(slot, p)), v});
      memops(push_, {}, waits);
      if (!try_graph([&] { launch(ag_graph(plan_ptr, slot), push_); })) issue(ag_data_copies(plan, slot), push_);
      // 3. The caller's stream: wait for every peer's pieces in my slot, and for my own pushes.
      waits.clear();
      for (int64_t p = 0; p < world_; ++p)
        if (p != rank_) waits.push_back(driver::MemOp{local_flag(flags_.ag_ready(slot, p)), v});
      memops(S, {}, waits);
      join(S, push_, ev_p_);
    }
    // 4. Outputs not bound in the slot: one more copy (the op-level API's general case).
    if (bound < 0 && !outs.empty()) {
      HostTimer t(host_ns_[kHKernel]);
      CastBatch out(static_cast<int>(ctas_), S);
      for (size_t j = 0; j < plan.size(); ++j) {
        const at::Tensor& o = outs[j];
        TORCH_CHECK(o.numel() == plan.out_numel[j], "tide.", op, ": outs[", num(j), "] has ", num(o.numel()),
                    " elements; the plan expects ", num(plan.out_numel[j]));
        out.add(reinterpret_cast<const void*>(mine + plan.out_off[j]), o.data_ptr(), o.numel(), plan.out_dtype[j],
                dtype_code(op, o.scalar_type()));
      }
      out.flush();
      kernels_ += out.launches();
    }
    return slot;
  }

  // TIDE-RS. reuse_slot >= 0 selects Slot-Reuse: every gradient not already at its param-major place in
  // that slot of this arena is copied there first (FSDP's Slot-Reuse hooks put them there as autograd
  // produces them), and the pushes read the slot; otherwise (In-Place) they read the gradients.
  void reduce_scatter(const std::shared_ptr<RsPlan>& plan_ptr, const std::vector<at::Tensor>& grads,
                      const std::vector<at::Tensor>& shard_grads, double scale, bool accumulate, int64_t reuse_slot) {
    static constexpr const char* op = "reduce_scatter_params_";
    const RsPlan& plan = *plan_ptr;
    HostTimer total(host_ns_[kHTotal]);
    ++calls_;
    TORCH_CHECK(static_cast<int64_t>(plan.rounds.size()) == world_, "tide.", op, ": plan built for another world size");
    TORCH_CHECK(reuse_slot < flags_.K, "tide.", op, ": reuse_slot ", num(reuse_slot), " >= ", num(flags_.K), " slots");
    TORCH_CHECK(reuse_slot < 0 || plan.slot_bytes <= slot_bytes_, "tide.", op, ": Slot-Reuse needs ", num(plan.slot_bytes),
                " bytes but a slot holds ", num(slot_bytes_));
    c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device_));
    cudaStream_t S = c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device_)).stream();
    check_not_capturing(op, S);
    const int64_t R = flags_.R;
    // Where the pushes and the own contribution read each gradient.
    src_.resize(grads.size());
    if (reuse_slot >= 0) {
      HostTimer t(host_ns_[kHKernel]);
      const uint64_t slot = slot_base(rank_, reuse_slot);
      CastBatch place(static_cast<int>(ctas_), S);
      for (size_t j = 0; j < grads.size(); ++j) {
        src_[j] = slot + static_cast<uint64_t>(plan.slot_off[j]);
        if (ptr_of(grads[j]) != src_[j])
          place.add(grads[j].data_ptr(), reinterpret_cast<void*>(src_[j]), grads[j].numel(), plan.grad_dtype[j],
                    plan.grad_dtype[j]);
      }
      place.flush();
      kernels_ += place.launches();
    } else {
      for (size_t j = 0; j < grads.size(); ++j) src_[j] = ptr_of(grads[j]);
    }
    {
      HostTimer t(host_ns_[kHEvent]);
      TIDE_CUDA("reduce_scatter_params_", cudaEventRecord(ev_s_, S));
      TIDE_CUDA("reduce_scatter_params_", cudaStreamWaitEvent(push_, ev_s_, 0));
      TIDE_CUDA("reduce_scatter_params_", cudaStreamWaitEvent(reduce_, ev_s_, 0));
    }
    const float fscale = static_cast<float>(scale);
    if (!accumulate && !plan.pads.empty()) {
      SumArgs a{};
      a.k = 1;
      a.own_rank = 0;
      a.scale = fscale;
      for (const auto& p : plan.pads) {
        a.seg[a.nseg++] = SumSegment{shard_grads[p[0]].data_ptr<float>() + p[1], nullptr, 0, p[2], kF32, 1};
        if (a.nseg == kMaxSegments) launch_sum(a);
      }
      launch_sum(a);
    }
    // Graph mode: the push graphs of this (plan, ring phase, gradient addresses).
    RsGraphs* graphs = nullptr;
    if (world_ > 1) try_graph([&] { graphs = &rs_graphs(plan_ptr, src_); });
    const uint64_t my_ring = bases_[rank_] + ring_off_;
    std::vector<driver::MemOp> writes, waits;
    for (int64_t j = 0; j < plan.max_rounds; ++j) {
      // Pushes of round j, destinations rotated so that the W producers start on different peers. All
      // flow-control waits of the round come first (each depends only on reductions of earlier
      // rounds), with the round's "ready" values written into one source word per destination.
      writes.clear();
      waits.clear();
      for (int64_t k = 1; k < world_; ++k) {
        const int64_t d = (rank_ + k) % world_;
        if (j >= static_cast<int64_t>(plan.rounds[d].size())) continue;
        const uint32_t g = static_cast<uint32_t>(rs_rounds_[d] + j + 1);
        const int64_t s = (g - 1) % R;
        if (g > R) waits.push_back(driver::MemOp{local_flag(flags_.rs_free(d, s)), g - static_cast<uint32_t>(R)});
        writes.push_back(driver::MemOp{local_flag(flags_.src_push(d)), g});
      }
      if (!writes.empty()) {
        memops(push_, writes, waits);
        if (graphs == nullptr || !try_graph([&] { launch(graphs->rounds[j], push_); }))
          issue(rs_round_copies(plan, j, src_, nullptr), push_);
      }
      // My own round j: wait for every contributor's entry, sum in rank order, hand the entries back.
      if (j < static_cast<int64_t>(plan.rounds[rank_].size())) {
        const uint32_t g = static_cast<uint32_t>(rs_rounds_[rank_] + j + 1);
        const int64_t s = (g - 1) % R;
        if (world_ > 1) {
          waits.clear();
          for (int64_t q = 0; q < world_; ++q)
            if (q != rank_) waits.push_back(driver::MemOp{local_flag(flags_.rs_ready(s, q)), g});
          // The "entry free" value goes into the reduce stream's source word now: the copies that read
          // its previous value are ordered before this, the ones that read this value after the sum.
          memops(reduce_, {driver::MemOp{local_flag(flags_.src_reduce()), g}}, waits);
        }
        SumArgs a{};
        a.staging = reinterpret_cast<const char*>(my_ring + s * world_ * entry_bytes_);
        a.stride = entry_bytes_;
        a.k = static_cast<int32_t>(world_);
        a.own_rank = static_cast<int32_t>(rank_);
        a.scale = fscale;
        a.accumulate = accumulate;
        int32_t dtype = -1;
        for (const RsChunk& c : plan.rounds[rank_][j]) {
          const int32_t dt = plan.grad_dtype[c.param];
          if ((dtype >= 0 && dt != dtype) || a.nseg == kMaxSegments) launch_sum(a);
          dtype = dt;
          const void* own = reinterpret_cast<const void*>(src_[c.param] + c.grad_off * dtype_size(dt));
          a.seg[a.nseg++] = SumSegment{shard_grads[c.param].data_ptr<float>() + c.shard_off, own, c.entry_off, c.n, dt, 0};
        }
        launch_sum(a);
        if (world_ > 1 && !try_graph([&] {
              CopyGraph& fg = rs_free_graphs_[s];
              if (!fg.exec) build_graph(fg, rs_free_copies(s));
              launch(fg, reduce_);
            }))
          issue(rs_free_copies(s), reduce_);
      }
    }
    for (int64_t d = 0; d < world_; ++d) rs_rounds_[d] += static_cast<int64_t>(plan.rounds[d].size());
    HostTimer t(host_ns_[kHEvent]);
    TIDE_CUDA("reduce_scatter_params_", cudaEventRecord(ev_p_, push_));
    TIDE_CUDA("reduce_scatter_params_", cudaEventRecord(ev_r_, reduce_));
    TIDE_CUDA("reduce_scatter_params_", cudaStreamWaitEvent(S, ev_p_, 0));
    TIDE_CUDA("reduce_scatter_params_", cudaStreamWaitEvent(S, ev_r_, 0));
  }

  // ------------------------------------------------------------------------------ op entry points
  // One Python -> C++ call per op: argument checks (messages as tide.meta.checks words them), plan
  // lookup, the collective. A plan not registered yet returns kNoPlan and does nothing; the caller
  // builds it (tide/transport/plans.py), registers it (add_*_plan) and calls again. Bad arguments
  // return kBadArgs with nothing issued, and the caller raises the error of tide.meta.checks (the
  // same conditions; the messages are built there only, on this rare path).
  static constexpr int64_t kNoPlan = -1;
  static constexpr int64_t kNoFit = -2;
  static constexpr int64_t kBadArgs = -3;

  // The slot gathered into, kNoPlan, kNoFit (the group needs more than a slot) or kBadArgs.
  int64_t all_gather_op(const std::vector<at::Tensor>& shards, const std::vector<at::Tensor>& outs) {
    if (shards.size() != outs.size() || !float_list(shards, false) || !float_list(outs, false) || !on_device(shards) ||
        !on_device(outs))
      return kBadArgs;
    for (size_t i = 0; i < shards.size(); ++i) {
      const at::Tensor& s = shards[i];
      const at::Tensor& o = outs[i];
      if (s.dim() == 0) return kBadArgs;
      std::vector<int64_t> full(s.sizes().begin(), s.sizes().end());
      full[0] *= world_;
      const bool is_flat = o.dim() == 1 && o.size(0) == world_ * s.numel();
      if (!is_flat && o.sizes().vec() != full) return kBadArgs;
    }
    auto it = ag_plans_.find(ag_key(shards, outs));
    if (it == ag_plans_.end()) return kNoPlan;
    if (it->second->slot_bytes > slot_bytes_) return kNoFit;
    return all_gather(it->second, shards, outs);
  }

  void add_ag_plan(const std::vector<at::Tensor>& shards, const std::vector<at::Tensor>& outs,
                   std::shared_ptr<AgPlan> plan) {
    TORCH_CHECK(plan != nullptr && plan->size() == shards.size(), "tide.add_ag_plan: the plan does not match the shards");
    ag_plans_[ag_key(shards, outs)] = std::move(plan);
  }

  // The mode that ran: 0 In-Place, 1 Slot-Reuse, 2 In-Place because the group does not fit a slot
  // (Slot-Reuse asked), 3 In-Place because some gradient already lies in the reuse slot away from its
  // place in this plan (placing it could overwrite another gradient before it is read: FSDP passes only
  // the params that have gradients, so the hooks' places, those of the whole group, may differ from
  // this plan's); or kNoPlan, kBadArgs.
  int64_t reduce_scatter_op(const std::vector<at::Tensor>& grads, const std::vector<at::Tensor>& shard_grads,
                            double scale, bool accumulate, int64_t reuse_slot) {
    if (grads.size() != shard_grads.size() || !float_list(grads, false) || !float_list(shard_grads, true) ||
        !on_device(grads) || !on_device(shard_grads))
      return kBadArgs;
    for (size_t i = 0; i < grads.size(); ++i) {
      std::vector<int64_t> want(grads[i].sizes().begin(), grads[i].sizes().end());
      if (want.empty()) want.push_back(1);  // a 0-d gradient is one row of one element
      want[0] = (want[0] + world_ - 1) / world_;
      if (shard_grads[i].sizes().vec() != want) return kBadArgs;
    }
    auto it = rs_plans_.find(rs_key(grads));
    if (it == rs_plans_.end()) return kNoPlan;
    int64_t ran = 0;
    if (reuse_slot >= 0) {
      const RsPlan& plan = *it->second;
      if (plan.slot_bytes > slot_bytes_) {
        ran = 2;
      } else {
        ran = 1;
        const uint64_t lo = slot_base(rank_, reuse_slot), hi = lo + static_cast<uint64_t>(slot_bytes_);
        for (size_t j = 0; j < grads.size() && ran == 1; ++j) {
          const uint64_t p = ptr_of(grads[j]);
          if (p >= lo && p < hi && p != lo + static_cast<uint64_t>(plan.slot_off[j])) ran = 3;
        }
      }
      if (ran != 1) reuse_slot = -1;
    }
    reduce_scatter(it->second, grads, shard_grads, scale, accumulate, reuse_slot);
    return ran;
  }

  void add_rs_plan(const std::vector<at::Tensor>& grads, std::shared_ptr<RsPlan> plan) {
    TORCH_CHECK(plan != nullptr && plan->grad_dtype.size() == grads.size(), "tide.add_rs_plan: the plan does not match the grads");
    rs_plans_[rs_key(grads)] = std::move(plan);
  }

  // copies, bytes, kernels, flags, graph launches, graphs built, graph node updates, re-points refused
  // (sets rebuilt), memop calls, copy-API calls, op calls, then host ns by HostCat.
  std::vector<int64_t> counters() const {
    std::vector<int64_t> c{copies_issued_, bytes_pushed_, kernels_, flags_posted_, graph_launches_, graphs_built_,
                           node_updates_, repoint_refusals_, memop_calls_, copy_api_calls_, calls_};
    c.insert(c.end(), host_ns_.begin(), host_ns_.end());
    return c;
  }

 private:
  struct AgGraphs {
    std::shared_ptr<AgPlan> plan;  // keeps the key's address from being reused
    CopyGraph data;
  };
  struct RsGraphs {
    std::shared_ptr<RsPlan> plan;
    std::vector<CopyGraph> rounds;  // push graph of round j (no exec when the round pushes nothing)
    // Per gradient, the nodes that read it: (round, node, byte offset in the gradient).
    std::vector<std::vector<std::array<int64_t, 3>>> uses;
    std::vector<uint64_t> src;  // the gradient addresses the nodes read now
  };
  static constexpr size_t kMaxGraphSets = 1024;  // cached graph sets in all before a flush

  uint64_t local_flag(int64_t word) const { return bases_[rank_] + flags_off_ + 4 * word; }
  uint64_t peer_flag(int64_t p, int64_t word) const { return bases_[p] + flags_off_ + 4 * word; }

  // Graph mode: runs f (build / update / launch of a copy graph) and returns true. If the CUDA runtime
  // refuses (an error before anything was enqueued), the arena switches to batch mode for good, with a
  // warning and the reason in graph_error(), and the caller issues the same copies through the batch
  // API. Other modes: false at once.
  template <typename F>
  bool try_graph(F&& f) {
    if (mode_ != kCeGraph) return false;
    try {
      f();
      return true;
    } catch (const std::exception& e) {
      (void)cudaGetLastError();  // the refused call's error is not sticky: clear it for later launch checks
      const auto* c10_error = dynamic_cast<const c10::Error*>(&e);
      graph_error_ = c10_error != nullptr ? c10_error->what_without_backtrace() : e.what();
      mode_ = kCeBatch;
      TORCH_WARN("tide.transport: copy graphs failed, this arena issues its copies with cudaMemcpyBatchAsync from now on: ",
                 graph_error_);
      return false;
    }
  }

  void check_not_capturing(const char* op, cudaStream_t S) const {
    cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
    TIDE_CUDA("transport", cudaStreamIsCapturing(S, &status));
    TORCH_CHECK(status == cudaStreamCaptureStatusNone, "tide.", op, ": the CUDA transport cannot run while the "
                "current stream is capturing a CUDA graph (the tide ops take the stock path under capture)");
  }

  // `waiter` continues after the work issued so far on `signaller`.
  void join(cudaStream_t waiter, cudaStream_t signaller, cudaEvent_t ev) {
    HostTimer t(host_ns_[kHEvent]);
    TIDE_CUDA("transport", cudaEventRecord(ev, signaller));
    TIDE_CUDA("transport", cudaStreamWaitEvent(waiter, ev, 0));
  }

  // Stream memory operations: the writes, then the waits, in one driver call where the driver allows.
  void memops(cudaStream_t stream, const std::vector<driver::MemOp>& writes, const std::vector<driver::MemOp>& waits) {
    if (writes.empty() && waits.empty()) return;
    HostTimer t(host_ns_[kHMemop]);
    if (batched_writes_) {
      driver::batch(stream, writes, waits);
      ++memop_calls_;
      return;
    }
    for (const auto& w : writes) {
      driver::write_value(stream, w.addr, w.value);
      ++memop_calls_;
    }
    if (!waits.empty()) {
      driver::batch(stream, {}, waits);
      ++memop_calls_;
    }
  }

  // --------------------------------------------------------------------------------- copy lists
  std::vector<Copy> ag_free_copies(int64_t slot) const {
    std::vector<Copy> list;
    const uint64_t src = local_flag(flags_.src_push(rank_));
    for (int64_t k = 1; k < world_; ++k) {
      const int64_t p = (rank_ + k) % world_;
      list.push_back(Copy{peer_flag(p, flags_.ag_free(slot, rank_)), src, 4, true});
    }
    return list;
  }

  std::vector<Copy> ag_data_copies(const AgPlan& plan, int64_t slot) const {
    std::vector<Copy> list;
    const uint64_t mine = slot_base(rank_, slot);
    const uint64_t src = local_flag(flags_.src_push(rank_));
    for (int64_t k = 1; k < world_; ++k) {
      const int64_t p = (rank_ + k) % world_;
      const uint64_t theirs = slot_base(p, slot);
      for (size_t j = 0; j < plan.size(); ++j)
        if (plan.own_bytes[j] > 0)
          list.push_back(Copy{theirs + plan.own_off[j], mine + plan.own_off[j], static_cast<size_t>(plan.own_bytes[j]), false});
      list.push_back(Copy{peer_flag(p, flags_.ag_ready(slot, rank_)), src, 4, true});
    }
    return list;
  }

  // My round-j pushes, destinations rotated, each destination's pieces followed by its "ready" flag
  // (from that destination's source word); gradient p is read at src[p]. `uses` receives
  // (param, node, byte offset in the gradient) of every data copy.
  std::vector<Copy> rs_round_copies(const RsPlan& plan, int64_t j, const std::vector<uint64_t>& src,
                                    std::vector<std::array<int64_t, 3>>* uses) const {
    std::vector<Copy> list;
    const int64_t R = flags_.R;
    for (int64_t k = 1; k < world_; ++k) {
      const int64_t d = (rank_ + k) % world_;
      if (j >= static_cast<int64_t>(plan.rounds[d].size())) continue;
      const int64_t s = (rs_rounds_[d] + j) % R;
      const uint64_t entry = bases_[d] + ring_off_ + (s * world_ + rank_) * entry_bytes_;
      for (const RsChunk& c : plan.rounds[d][j]) {
        const int sz = dtype_size(plan.grad_dtype[c.param]);
        const int64_t bytes = c.n * sz;
        if (bytes <= 0) continue;
        const int64_t off = c.grad_off * sz;
        if (uses != nullptr) uses->push_back({c.param, static_cast<int64_t>(list.size()), off});
        list.push_back(Copy{entry + c.entry_off, src[c.param] + off, static_cast<size_t>(bytes), false});
      }
      list.push_back(Copy{peer_flag(d, flags_.rs_ready(s, rank_)), local_flag(flags_.src_push(d)), 4, true});
    }
    return list;
  }

  std::vector<Copy> rs_free_copies(int64_t s) const {
    std::vector<Copy> list;
    const uint64_t src = local_flag(flags_.src_reduce());
    for (int64_t k = 1; k < world_; ++k) {
      const int64_t q = (rank_ + k) % world_;
      list.push_back(Copy{peer_flag(q, flags_.rs_free(rank_, s)), src, 4, true});
    }
    return list;
  }

  // --------------------------------------------------------------------------------- graphs
  // Instantiates `list` as one chain of memcpy nodes into g (left empty, no exec, for an empty list).
  void build_graph(CopyGraph& g, std::vector<Copy> list) {
    HostTimer t(host_ns_[kHGraphBuild]);
    destroy_graph(g);
    g.copies = std::move(list);
    g.data_copies = g.flag_copies = g.data_bytes = 0;
    for (const Copy& c : g.copies) {
      if (c.flag) {
        ++g.flag_copies;
      } else {
        ++g.data_copies;
        g.data_bytes += static_cast<int64_t>(c.bytes);
      }
    }
    if (g.copies.empty()) return;
    try {
      TIDE_CUDA("transport", cudaGraphCreate(&g.graph, 0));
      g.nodes.resize(g.copies.size());
      for (size_t i = 0; i < g.copies.size(); ++i) {
        const Copy& c = g.copies[i];
        TIDE_CUDA("transport", cudaGraphAddMemcpyNode1D(&g.nodes[i], g.graph, i > 0 ? &g.nodes[i - 1] : nullptr, i > 0 ? 1 : 0,
                                                        reinterpret_cast<void*>(c.dst), reinterpret_cast<const void*>(c.src),
                                                        c.bytes, cudaMemcpyDefault));
      }
      TIDE_CUDA("transport", cudaGraphInstantiate(&g.exec, g.graph, 0));
    } catch (...) {
      destroy_graph(g);
      throw;
    }
    ++graphs_built_;
  }

  void launch(const CopyGraph& g, cudaStream_t stream) {
    if (g.exec == nullptr) return;
    HostTimer t(host_ns_[kHGraphLaunch]);
    TIDE_CUDA("transport", cudaGraphLaunch(g.exec, stream));
    ++graph_launches_;
    copies_issued_ += g.data_copies;
    bytes_pushed_ += g.data_bytes;
    flags_posted_ += g.flag_copies;
  }

  void clear_plan_graphs() {
    for (auto& kv : ag_graphs_) destroy_graph(kv.second.data);
    for (auto& kv : rs_graphs_)
      for (auto& gs : kv.second)
        for (auto& g : gs.rounds) destroy_graph(g);
    ag_graphs_.clear();
    rs_graphs_.clear();
  }

  const CopyGraph& ag_graph(const std::shared_ptr<AgPlan>& plan, int64_t slot) {
    const auto key = std::make_pair(static_cast<const AgPlan*>(plan.get()), slot);
    auto it = ag_graphs_.find(key);
    if (it != ag_graphs_.end()) return it->second.data;
    if (graph_sets() >= kMaxGraphSets) clear_plan_graphs();
    AgGraphs entry;
    entry.plan = plan;
    build_graph(entry.data, ag_data_copies(*plan, slot));
    return ag_graphs_.emplace(key, std::move(entry)).first->second.data;
  }

  // The push graphs of `plan` at the current ring phase reading the gradients at `src`. Up to
  // max_graph_sets_ address sets are kept per (plan, phase), most recently used first: FSDP's blocks
  // share a plan and each finds its own graphs again at the next step (gradients come back at the same
  // addresses when every step allocates alike; Slot-Reuse reads fixed slot addresses). An address set
  // not cached builds a new graph set while there is room, else re-points the least recently used
  // one's nodes at the gradients that moved (rebuilding it if the runtime refuses the new addresses).
  RsGraphs& rs_graphs(const std::shared_ptr<RsPlan>& plan, const std::vector<uint64_t>& src) {
    const int64_t R = flags_.R;
    std::vector<int64_t> phase(world_);
    for (int64_t d = 0; d < world_; ++d) phase[d] = rs_rounds_[d] % R;
    auto key = std::make_pair(static_cast<const RsPlan*>(plan.get()), std::move(phase));
    auto found = rs_graphs_.find(key);
    if (found != rs_graphs_.end()) {
      std::list<RsGraphs>& sets = found->second;
      for (auto it = sets.begin(); it != sets.end(); ++it)
        if (it->src == src) {
          sets.splice(sets.begin(), sets, it);
          return sets.front();
        }
      if (static_cast<int64_t>(sets.size()) >= max_graph_sets_) {
        sets.splice(sets.begin(), sets, std::prev(sets.end()));
        RsGraphs& gs = sets.front();
        if (!repoint(gs, src)) {
          try {
            build_set(gs, plan, src);
          } catch (...) {  // no half-built set stays cached
            sets.pop_front();
            if (sets.empty()) rs_graphs_.erase(found);
            throw;
          }
        }
        return gs;
      }
    }
    if (graph_sets() >= kMaxGraphSets) clear_plan_graphs();
    std::list<RsGraphs>& sets = rs_graphs_[key];
    sets.emplace_front();
    try {
      build_set(sets.front(), plan, src);
    } catch (...) {
      sets.pop_front();
      if (sets.empty()) rs_graphs_.erase(key);
      throw;
    }
    return sets.front();
  }

  // (Re)builds every round's push graph of `gs` for the gradients at `src`.
  void build_set(RsGraphs& gs, const std::shared_ptr<RsPlan>& plan, const std::vector<uint64_t>& src) {
    for (auto& g : gs.rounds) destroy_graph(g);
    gs.plan = plan;
    gs.rounds.assign(plan->max_rounds, CopyGraph{});
    gs.uses.assign(src.size(), {});
    gs.src.clear();
    try {
      for (int64_t j = 0; j < plan->max_rounds; ++j) {
        std::vector<std::array<int64_t, 3>> uses;
        build_graph(gs.rounds[j], rs_round_copies(*plan, j, src, &uses));
        for (const auto& u : uses) gs.uses[u[0]].push_back({j, u[1], u[2]});
      }
    } catch (...) {
      for (auto& g : gs.rounds) destroy_graph(g);
      throw;
    }
    gs.src = src;
  }

  // Points the nodes of `gs` that read a gradient whose address changed at its new address. False
  // (the error cleared, `gs` to be rebuilt) when the runtime refuses: an exec update cannot move a
  // node between memory kinds, e.g. from caching-allocator memory to the arena's mapped memory.
  bool repoint(RsGraphs& gs, const std::vector<uint64_t>& src) {
    HostTimer t(host_ns_[kHGraphUpdate]);
    for (size_t p = 0; p < src.size(); ++p) {
      if (src[p] == gs.src[p]) continue;
      for (const auto& u : gs.uses[p]) {
        CopyGraph& g = gs.rounds[u[0]];
        Copy& c = g.copies[u[1]];
        c.src = src[p] + u[2];
        if (cudaGraphExecMemcpyNodeSetParams1D(g.exec, g.nodes[u[1]], reinterpret_cast<void*>(c.dst),
                                               reinterpret_cast<const void*>(c.src), c.bytes,
                                               cudaMemcpyDefault) != cudaSuccess) {
          (void)cudaGetLastError();
          ++repoint_refusals_;
          return false;
        }
        ++node_updates_;
      }
      gs.src[p] = src[p];
    }
    return true;
  }

  size_t graph_sets() const {
    size_t n = ag_graphs_.size();
    for (const auto& kv : rs_graphs_) n += kv.second.size();
    return n;
  }

  void launch_sum(SumArgs& a) {
    if (a.nseg == 0) return;
    HostTimer t(host_ns_[kHKernel]);
    launch_sum_contributions(a, static_cast<int>(ctas_), reduce_);
    ++kernels_;
    a.nseg = 0;
  }

  // Batch / loop modes: the copies of `list` in order; in batch mode each run of data copies is one
  // cudaMemcpyBatchAsync (a flag copy ends a run, so it follows its data), flags one cudaMemcpyAsync each.
  void issue(const std::vector<Copy>& list, cudaStream_t stream) {
    if (list.empty()) return;
    HostTimer t(host_ns_[kHCopyApi]);
    size_t i = 0;
    while (i < list.size()) {
      size_t e = i + 1;
      if (!list[i].flag && mode_ == kCeBatch)
        while (e < list.size() && !list[e].flag) ++e;
#if CUDART_VERSION >= 13000
      if (e - i > 1) {
        dsts_.clear();
        srcs_.clear();
        sizes_.clear();
        for (size_t k = i; k < e; ++k) {
          dsts_.push_back(reinterpret_cast<void*>(list[k].dst));
          srcs_.push_back(reinterpret_cast<const void*>(list[k].src));
          sizes_.push_back(list[k].bytes);
        }
        cudaMemcpyAttributes attr{};
        attr.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
        attr.flags = cudaMemcpyFlagPreferOverlapWithCompute;
        size_t attr_idx = 0;
        TIDE_CUDA("transport", cudaMemcpyBatchAsync(dsts_.data(), srcs_.data(), sizes_.data(), e - i, &attr, &attr_idx, 1, stream));
        ++copy_api_calls_;
      } else
#endif
      {
        for (size_t k = i; k < e; ++k) {
          TIDE_CUDA("transport", cudaMemcpyAsync(reinterpret_cast<void*>(list[k].dst), reinterpret_cast<const void*>(list[k].src),
                                                 list[k].bytes, cudaMemcpyDefault, stream));
          ++copy_api_calls_;
        }
      }
      for (size_t k = i; k < e; ++k) {
        if (list[k].flag) {
          ++flags_posted_;
        } else {
          ++copies_issued_;
          bytes_pushed_ += static_cast<int64_t>(list[k].bytes);
        }
      }
      i = e;
    }
  }

  // ------------------------------------------------------------------------------ argument checks
  static bool float_list(const std::vector<at::Tensor>& ts, bool fp32_only) {
    for (const auto& t : ts) {
      const at::ScalarType st = t.scalar_type();
      const bool ok = fp32_only ? st == at::kFloat : (st == at::kFloat || st == at::kBFloat16 || st == at::kHalf);
      if (!ok || !t.is_contiguous()) return false;
    }
    return true;
  }

  bool on_device(const std::vector<at::Tensor>& ts) const {
    const at::Device dev(at::kCUDA, static_cast<c10::DeviceIndex>(device_));
    for (const auto& t : ts)
      if (t.device() != dev) return false;
    return true;
  }

  static PlanKey ag_key(const std::vector<at::Tensor>& shards, const std::vector<at::Tensor>& outs) {
    PlanKey key;
    key.reserve(4 * shards.size());
    for (size_t i = 0; i < shards.size(); ++i) {
      key.push_back(dtype_code("all_gather_into_params_", outs[i].scalar_type()));
      key.push_back(shards[i].dim());
      for (int64_t x : shards[i].sizes()) key.push_back(x);
    }
    return key;
  }

  static PlanKey rs_key(const std::vector<at::Tensor>& grads) {
    PlanKey key;
    key.reserve(4 * grads.size());
    for (const auto& g : grads) {
      key.push_back(dtype_code("reduce_scatter_params_", g.scalar_type()));
      key.push_back(g.dim());
      for (int64_t x : g.sizes()) key.push_back(x);
    }
    return key;
  }

  int64_t rank_, world_, device_, flags_off_, slots_off_, slot_bytes_, ring_off_, entry_bytes_, ctas_, mode_;
  int64_t max_graph_sets_;
  bool batched_writes_ = false;
  std::string graph_error_;
  FlagLayout flags_;
  std::vector<uint64_t> bases_;
  std::vector<uint32_t> ag_uses_;
  std::vector<int64_t> rs_rounds_;
  int64_t ring_pos_ = 0;
  cudaStream_t push_ = nullptr, reduce_ = nullptr;
  cudaEvent_t ev_s_ = nullptr, ev_p_ = nullptr, ev_r_ = nullptr;
  std::map<std::pair<const AgPlan*, int64_t>, AgGraphs> ag_graphs_;
  std::map<std::pair<const RsPlan*, std::vector<int64_t>>, std::list<RsGraphs>> rs_graphs_;
  std::vector<CopyGraph> ag_free_graphs_;  // per all-gather slot: "slot free" flags to every peer
  std::vector<CopyGraph> rs_free_graphs_;  // per staging slot: "entry free" flags to every producer
  std::vector<void*> dsts_;
  std::vector<const void*> srcs_;
  std::vector<size_t> sizes_;
  std::vector<uint64_t> src_;  // where the current reduce-scatter reads each gradient
  std::unordered_map<PlanKey, std::shared_ptr<AgPlan>, PlanKeyHash> ag_plans_;
  std::unordered_map<PlanKey, std::shared_ptr<RsPlan>, PlanKeyHash> rs_plans_;
  int64_t copies_issued_ = 0, bytes_pushed_ = 0, kernels_ = 0, flags_posted_ = 0;
  int64_t graph_launches_ = 0, graphs_built_ = 0, node_updates_ = 0, memop_calls_ = 0, copy_api_calls_ = 0, calls_ = 0;
  int64_t repoint_refusals_ = 0;
  std::array<int64_t, kHCats> host_ns_{};
};

// Standalone summing kernel over K equally strided local buffers (the benchmark and the kernel tests):
// out[i] (+)= scale * sum_k x_k[i] with x_k = base + k * stride_bytes.
void sum_strided(const at::Tensor& out, const at::Tensor& base, int64_t k, int64_t stride_bytes, int64_t n, double scale,
                 bool accumulate, int64_t ctas) {
  static constexpr const char* op = "sum_contributions";
  TORCH_CHECK(out.is_cuda() && base.is_cuda(), "tide.", op, ": out and base must be CUDA tensors");
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.is_contiguous() && out.numel() >= n, "tide.", op,
              ": out must be a contiguous fp32 tensor of at least n elements");
  TORCH_CHECK(k >= 1 && base.numel() * base.element_size() >= (k - 1) * stride_bytes + n * base.element_size(), "tide.",
              op, ": base is too small for k strided contributions");
  c10::cuda::CUDAGuard guard(out.device());
  SumArgs a{};
  a.staging = static_cast<const char*>(base.data_ptr());
  a.stride = stride_bytes;
  a.k = static_cast<int32_t>(k);
  a.own_rank = -1;
  a.scale = static_cast<float>(scale);
  a.accumulate = accumulate;
  a.nseg = 1;
  a.seg[0] = SumSegment{out.data_ptr<float>(), nullptr, 0, n, dtype_code(op, base.scalar_type()), 0};
  launch_sum_contributions(a, static_cast<int>(ctas), c10::cuda::getCurrentCUDAStream().stream());
}

// Points the storage of each output (all its views see it) at `nbytes[i]` of device memory at
// `base + offsets[i]`, not owned: the way FSDP2's resize_ gives an all-gather output its memory, but into
// an arena slot. One call per unshard. False, with nothing bound, unless every output is a 1-D tensor on
// `device` that starts its storage and has exactly `nbytes[i]` bytes (the caller raises the error).
bool bind_storages(const std::vector<at::Tensor>& outs, int64_t device, int64_t base,
                   const std::vector<int64_t>& offsets, const std::vector<int64_t>& nbytes) {
  if (offsets.size() != outs.size() || nbytes.size() != outs.size()) return false;
  for (size_t i = 0; i < outs.size(); ++i) {
    const at::Tensor& t = outs[i];
    if (!t.defined() || !t.is_cuda() || t.get_device() != device || t.dim() != 1 || t.storage_offset() != 0 ||
        t.numel() * static_cast<int64_t>(t.element_size()) != nbytes[i])
      return false;
  }
  for (size_t i = 0; i < outs.size(); ++i) {
    auto* impl = outs[i].storage().unsafeGetStorageImpl();
    impl->set_data_ptr_noswap(c10::DataPtr(reinterpret_cast<void*>(base + offsets[i]), outs[i].device()));
    impl->set_nbytes(static_cast<size_t>(nbytes[i]));
  }
  return true;
}

}  // namespace tide

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  namespace py = pybind11;
  using namespace tide;
  m.doc() = "TIDE CUDA transport: zero-SM TIDE-AG, bounded-grid TIDE-RS, symmetric-arena flags";
  py::class_<AgPlan, std::shared_ptr<AgPlan>>(m, "AgPlan")
      .def(py::init<std::vector<int64_t>, std::vector<int64_t>, std::vector<int64_t>, std::vector<int64_t>,
                    std::vector<int64_t>, int64_t>());
  py::class_<RsPlan, std::shared_ptr<RsPlan>>(m, "RsPlan")
      .def(py::init<const std::vector<std::vector<std::vector<int64_t>>>&, std::vector<std::vector<int64_t>>,
                    std::vector<int64_t>, std::vector<int64_t>, int64_t>())
      .def_readonly("max_rounds", &RsPlan::max_rounds)
      .def_readonly("slot_bytes", &RsPlan::slot_bytes);
  py::class_<Arena, std::shared_ptr<Arena>>(m, "Arena")
      .def(py::init<int64_t, int64_t, std::vector<int64_t>, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,
                    int64_t, int64_t, int64_t, int64_t>())
      .def("all_gather", &Arena::all_gather_op)
      .def("add_ag_plan", &Arena::add_ag_plan)
      .def("reduce_scatter", &Arena::reduce_scatter_op)
      .def("add_rs_plan", &Arena::add_rs_plan)
      .def("next_slot", &Arena::next_slot)
      .def("num_slots", &Arena::num_slots)
      .def("flag_words", &Arena::flag_words)
      .def("ce_mode", &Arena::ce_mode)
      .def("graph_error", &Arena::graph_error)
      .def("batched_writes", &Arena::batched_writes)
      .def("counters", &Arena::counters)
      .def_readonly_static("NO_PLAN", &Arena::kNoPlan)
      .def_readonly_static("NO_FIT", &Arena::kNoFit)
      .def_readonly_static("BAD_ARGS", &Arena::kBadArgs);
  m.def("sum_strided", &sum_strided);
  m.def("bind_storages", &bind_storages);
  m.def("driver_available", &driver::available);
}
