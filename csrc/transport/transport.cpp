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
// TIDE-RS, rank r (In-Place: pieces read from autograd's gradients; Slot-Reuse: from a slot into which
// they were packed first), for every round j, destinations in a rotation, g = rounds done for d + 1:
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
#include <memory>
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
    default: TORCH_CHECK(false, "tide.", op, ": unsupported dtype ", t, " (bf16, fp16 or fp32)");
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
  // Source words of the 4-B flag copies, one per stream (written by that stream only).
  int64_t src_word(int64_t stream_id) const { return 2 * K * W + 2 * R * W + stream_id; }
  int64_t words() const { return 2 * K * W + 2 * R * W + 4; }
};
enum StreamId : int64_t { kS = 0, kP = 1, kRd = 2 };

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
  std::vector<std::vector<int64_t>> pack_off;  // Slot-Reuse: bytes in the slot of round (d, j)
  std::vector<std::vector<int64_t>> round_bytes;  // bytes used in the staging entry by round (d, j)
  int64_t pack_bytes;
  int64_t max_rounds = 0;

  RsPlan(const std::vector<std::vector<std::vector<int64_t>>>& rounds_flat,
         std::vector<std::vector<int64_t>> pads_, std::vector<int64_t> grad_dtype_,
         std::vector<std::vector<int64_t>> pack_off_, std::vector<std::vector<int64_t>> round_bytes_,
         int64_t pack_bytes_)
      : pack_off(std::move(pack_off_)), round_bytes(std::move(round_bytes_)), pack_bytes(pack_bytes_) {
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
  }
};

class Arena {
 public:
  Arena(int64_t rank, int64_t world, std::vector<int64_t> bases, int64_t device, int64_t flags_off,
        int64_t slots_off, int64_t slot_bytes, int64_t num_slots, int64_t ring_off, int64_t entry_bytes,
        int64_t ring_depth, int64_t ctas, bool batch_copies)
      : rank_(rank), world_(world), device_(device), flags_off_(flags_off), slots_off_(slots_off),
        slot_bytes_(slot_bytes), ring_off_(ring_off), entry_bytes_(entry_bytes), ctas_(ctas),
        batch_copies_(batch_copies), flags_{num_slots, ring_depth, world} {
    TORCH_CHECK(world >= 1 && rank >= 0 && rank < world, "tide.Arena: rank ", rank, " not in [0, ", world, ")");
    TORCH_CHECK(static_cast<int64_t>(bases.size()) == world, "tide.Arena: need one base pointer per rank");
    TORCH_CHECK(num_slots >= 1 && ring_depth >= 1, "tide.Arena: num_slots and ring_depth must be >= 1");
    TORCH_CHECK(entry_bytes % 16 == 0 && slot_bytes % 16 == 0, "tide.Arena: entry_bytes and slot_bytes must be multiples of 16");
    TORCH_CHECK(driver::available(), "tide.Arena: the CUDA driver lacks stream memory operations (cuStreamBatchMemOp)");
    for (auto b : bases) bases_.push_back(static_cast<uint64_t>(b));
    ag_uses_.assign(num_slots, 0);
    rs_rounds_.assign(world, 0);
    c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
    int lo = 0, hi = 0;
    TIDE_CUDA("Arena", cudaDeviceGetStreamPriorityRange(&lo, &hi));
    TIDE_CUDA("Arena", cudaStreamCreateWithPriority(&push_, cudaStreamNonBlocking, lo));
    // The summing CTAs get the highest priority, so they are scheduled ahead of the model's kernels.
    TIDE_CUDA("Arena", cudaStreamCreateWithPriority(&reduce_, cudaStreamNonBlocking, hi));
    for (auto* e : {&ev_s_, &ev_p_, &ev_r_}) TIDE_CUDA("Arena", cudaEventCreateWithFlags(e, cudaEventDisableTiming));
  }

  ~Arena() {
    // Streams and events are left to process teardown when the context is already gone.
    if (cudaSetDevice(static_cast<int>(device_)) != cudaSuccess) return;
    cudaStreamSynchronize(push_);
    cudaStreamSynchronize(reduce_);
    cudaEventDestroy(ev_s_);
    cudaEventDestroy(ev_p_);
    cudaEventDestroy(ev_r_);
    cudaStreamDestroy(push_);
    cudaStreamDestroy(reduce_);
  }

  int64_t next_slot() const { return ring_pos_; }
  int64_t num_slots() const { return flags_.K; }
  int64_t flag_words() const { return flags_.words(); }
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
  int64_t all_gather(const AgPlan& plan, const std::vector<at::Tensor>& shards, const std::vector<at::Tensor>& outs) {
    static constexpr const char* op = "all_gather_into_params_";
    TORCH_CHECK(shards.size() == plan.size(), "tide.", op, ": ", shards.size(), " shards for a plan of ", plan.size());
    TORCH_CHECK(outs.empty() || outs.size() == plan.size(), "tide.", op, ": ", outs.size(), " outs for a plan of ", plan.size());
    TORCH_CHECK(plan.slot_bytes <= slot_bytes_, "tide.", op, ": the group needs ", plan.slot_bytes,
                " slot bytes but the arena's slots hold ", slot_bytes_, " (enable TIDE with a larger slot)");
    c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device_));
    cudaStream_t S = c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device_)).stream();
    const int64_t bound = bound_slot(plan, outs);
    const int64_t slot = bound >= 0 ? bound : ring_pos_;
    ring_pos_ = (slot + 1) % flags_.K;
    const uint32_t v = ++ag_uses_[slot];
    const uint64_t mine = slot_base(rank_, slot);

    // 1. The own shard, cast straight into its final place in my slot: the op's only kernel.
    CastBatch cast(static_cast<int>(ctas_), S);
    for (size_t j = 0; j < plan.size(); ++j) {
      const at::Tensor& s = shards[j];
      TORCH_CHECK(s.numel() * dtype_size(plan.out_dtype[j]) == plan.own_bytes[j], "tide.", op, ": shards[", j,
                  "] has ", s.numel(), " elements; the plan expects ", plan.own_bytes[j] / dtype_size(plan.out_dtype[j]));
      cast.add(s.data_ptr(), reinterpret_cast<void*>(mine + plan.own_off[j]), s.numel(), dtype_code(op, s.scalar_type()),
               plan.out_dtype[j]);
    }
    cast.flush();
    kernels_ += cast.launches();
    if (world_ > 1) {
      // 2. My slot may now be written by every peer.
      post(S, kS, [&](int64_t) { return flags_.ag_free(slot, rank_); }, v);
      // 3. Push stream: wait for every peer's slot, copy my pieces to their final addresses, flag.
      TIDE_CUDA("all_gather_into_params_", cudaEventRecord(ev_s_, S));
      TIDE_CUDA("all_gather_into_params_", cudaStreamWaitEvent(push_, ev_s_, 0));
      std::vector<uint64_t> words;
      for (int64_t p = 0; p < world_; ++p)
        if (p != rank_) words.push_back(local_flag(flags_.ag_free(slot, p)));
      driver::wait_geq(push_, words, v);
      copies_.clear();
      for (int64_t k = 1; k < world_; ++k) {
        const int64_t p = (rank_ + k) % world_;
        const uint64_t theirs = slot_base(p, slot);
        for (size_t j = 0; j < plan.size(); ++j)
          if (plan.own_bytes[j] > 0) copies_.push_back({theirs + plan.own_off[j], mine + plan.own_off[j], static_cast<size_t>(plan.own_bytes[j])});
      }
      issue_copies(push_);
      post(push_, kP, [&](int64_t) { return flags_.ag_ready(slot, rank_); }, v);
      // 4. The caller's stream: wait for every peer's pieces in my slot, and for my own pushes.
      words.clear();
      for (int64_t p = 0; p < world_; ++p)
        if (p != rank_) words.push_back(local_flag(flags_.ag_ready(slot, p)));
      driver::wait_geq(S, words, v);
      TIDE_CUDA("all_gather_into_params_", cudaEventRecord(ev_p_, push_));
      TIDE_CUDA("all_gather_into_params_", cudaStreamWaitEvent(S, ev_p_, 0));
    }
    // 5. Outputs not bound in the slot: one more copy (the op-level API's general case).
    if (bound < 0 && !outs.empty()) {
      CastBatch out(static_cast<int>(ctas_), S);
      for (size_t j = 0; j < plan.size(); ++j) {
        const at::Tensor& o = outs[j];
        TORCH_CHECK(o.numel() == plan.out_numel[j], "tide.", op, ": outs[", j, "] has ", o.numel(),
                    " elements; the plan expects ", plan.out_numel[j]);
        out.add(reinterpret_cast<const void*>(mine + plan.out_off[j]), o.data_ptr(), o.numel(), plan.out_dtype[j],
                dtype_code(op, o.scalar_type()));
      }
      out.flush();
      kernels_ += out.launches();
    }
    return slot;
  }

  // TIDE-RS. reuse_slot >= 0 selects Slot-Reuse: pack the gradients into that slot of this arena first.
  void reduce_scatter(const RsPlan& plan, const std::vector<at::Tensor>& grads, const std::vector<at::Tensor>& shard_grads,
                      double scale, bool accumulate, int64_t reuse_slot) {
    static constexpr const char* op = "reduce_scatter_params_";
    TORCH_CHECK(grads.size() == plan.grad_dtype.size() && shard_grads.size() == grads.size(), "tide.", op,
                ": ", grads.size(), " grads and ", shard_grads.size(), " shard_grads for a plan of ", plan.grad_dtype.size());
    TORCH_CHECK(static_cast<int64_t>(plan.rounds.size()) == world_, "tide.", op, ": plan built for another world size");
    TORCH_CHECK(reuse_slot < flags_.K, "tide.", op, ": reuse_slot ", reuse_slot, " >= ", flags_.K, " slots");
    TORCH_CHECK(reuse_slot < 0 || plan.pack_bytes <= slot_bytes_, "tide.", op, ": Slot-Reuse needs ", plan.pack_bytes,
                " bytes but a slot holds ", slot_bytes_);
    for (size_t j = 0; j < grads.size(); ++j) {
      TORCH_CHECK(dtype_code(op, grads[j].scalar_type()) == plan.grad_dtype[j], "tide.", op, ": grads[", j,
                  "] dtype differs from the plan's");
      TORCH_CHECK(shard_grads[j].scalar_type() == at::kFloat, "tide.", op, ": shard_grads[", j, "] must be fp32");
    }
    c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device_));
    cudaStream_t S = c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device_)).stream();
    const int64_t R = flags_.R;
    const uint64_t packed = reuse_slot >= 0 ? slot_base(rank_, reuse_slot) : 0;
    if (reuse_slot >= 0) {
      // Slot-Reuse: every destination's rounds laid out back to back, so each push is one copy.
      CastBatch pack(static_cast<int>(ctas_), S);
      for (int64_t d = 0; d < world_; ++d)
        for (size_t j = 0; j < plan.rounds[d].size(); ++j)
          for (const RsChunk& c : plan.rounds[d][j]) {
            const int32_t dt = plan.grad_dtype[c.param];
            pack.add(static_cast<const char*>(grads[c.param].data_ptr()) + c.grad_off * dtype_size(dt),
                     reinterpret_cast<void*>(packed + plan.pack_off[d][j] + c.entry_off), c.n, dt, dt);
          }
      pack.flush();
      kernels_ += pack.launches();
    }
    TIDE_CUDA("reduce_scatter_params_", cudaEventRecord(ev_s_, S));
    TIDE_CUDA("reduce_scatter_params_", cudaStreamWaitEvent(push_, ev_s_, 0));
    TIDE_CUDA("reduce_scatter_params_", cudaStreamWaitEvent(reduce_, ev_s_, 0));
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
    const uint64_t my_ring = bases_[rank_] + ring_off_;
    for (int64_t j = 0; j < plan.max_rounds; ++j) {
      // Pushes of round j, destinations rotated so that the W producers start on different peers.
      for (int64_t k = 1; k < world_; ++k) {
        const int64_t d = (rank_ + k) % world_;
        if (j >= static_cast<int64_t>(plan.rounds[d].size())) continue;
        const uint32_t g = static_cast<uint32_t>(rs_rounds_[d] + j + 1);
        const int64_t s = (g - 1) % R;
        if (g > R) driver::wait_geq(push_, {local_flag(flags_.rs_free(d, s))}, g - static_cast<uint32_t>(R));
        const uint64_t entry = bases_[d] + ring_off_ + (s * world_ + rank_) * entry_bytes_;
        copies_.clear();
        if (reuse_slot >= 0) {
          if (plan.round_bytes[d][j] > 0)
            copies_.push_back({entry, packed + plan.pack_off[d][j], static_cast<size_t>(plan.round_bytes[d][j])});
        } else {
          for (const RsChunk& c : plan.rounds[d][j]) {
            const int sz = dtype_size(plan.grad_dtype[c.param]);
            copies_.push_back({entry + c.entry_off, ptr_of(grads[c.param]) + c.grad_off * sz, static_cast<size_t>(c.n * sz)});
          }
        }
        issue_copies(push_);
        post_one(push_, kP, d, flags_.rs_ready(s, rank_), g);
      }
      // My own round j: wait for every contributor's entry, sum in rank order, hand the entries back.
      if (j < static_cast<int64_t>(plan.rounds[rank_].size())) {
        const uint32_t g = static_cast<uint32_t>(rs_rounds_[rank_] + j + 1);
        const int64_t s = (g - 1) % R;
        if (world_ > 1) {
          std::vector<uint64_t> words;
          for (int64_t q = 0; q < world_; ++q)
            if (q != rank_) words.push_back(local_flag(flags_.rs_ready(s, q)));
          driver::wait_geq(reduce_, words, g);
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
          const void* own = reuse_slot >= 0
              ? reinterpret_cast<const void*>(packed + plan.pack_off[rank_][j] + c.entry_off)
              : static_cast<const void*>(static_cast<const char*>(grads[c.param].data_ptr()) + c.grad_off * dtype_size(dt));
          a.seg[a.nseg++] = SumSegment{shard_grads[c.param].data_ptr<float>() + c.shard_off, own, c.entry_off, c.n, dt, 0};
        }
        launch_sum(a);
        if (world_ > 1) post(reduce_, kRd, [&](int64_t) { return flags_.rs_free(rank_, s); }, g);
      }
    }
    for (int64_t d = 0; d < world_; ++d) rs_rounds_[d] += static_cast<int64_t>(plan.rounds[d].size());
    TIDE_CUDA("reduce_scatter_params_", cudaEventRecord(ev_p_, push_));
    TIDE_CUDA("reduce_scatter_params_", cudaEventRecord(ev_r_, reduce_));
    TIDE_CUDA("reduce_scatter_params_", cudaStreamWaitEvent(S, ev_p_, 0));
    TIDE_CUDA("reduce_scatter_params_", cudaStreamWaitEvent(S, ev_r_, 0));
  }

  std::vector<int64_t> counters() const { return {copies_issued_, bytes_pushed_, kernels_, flags_posted_}; }

 private:
  struct Copy {
    uint64_t dst, src;
    size_t bytes;
  };

  uint64_t local_flag(int64_t word) const { return bases_[rank_] + flags_off_ + 4 * word; }
  uint64_t peer_flag(int64_t p, int64_t word) const { return bases_[p] + flags_off_ + 4 * word; }

  // Writes `value` into flag word word_of(p) of every peer p: a front-end write of the value into
  // this stream's source word, then one 4-byte copy per peer (NCCL's unicast CE sync).
  template <typename F>
  void post(cudaStream_t stream, int64_t sid, F word_of, uint32_t value) {
    const uint64_t src = local_flag(flags_.src_word(sid));
    driver::write_value(stream, src, value);
    for (int64_t k = 1; k < world_; ++k) {
      const int64_t p = (rank_ + k) % world_;
      TIDE_CUDA("transport", cudaMemcpyAsync(reinterpret_cast<void*>(peer_flag(p, word_of(p))),
                                             reinterpret_cast<const void*>(src), 4, cudaMemcpyDefault, stream));
      ++flags_posted_;
    }
  }
  void post_one(cudaStream_t stream, int64_t sid, int64_t p, int64_t word, uint32_t value) {
    const uint64_t src = local_flag(flags_.src_word(sid));
    driver::write_value(stream, src, value);
    TIDE_CUDA("transport", cudaMemcpyAsync(reinterpret_cast<void*>(peer_flag(p, word)),
                                           reinterpret_cast<const void*>(src), 4, cudaMemcpyDefault, stream));
    ++flags_posted_;
  }

  void launch_sum(SumArgs& a) {
    if (a.nseg == 0) return;
    launch_sum_contributions(a, static_cast<int>(ctas_), reduce_);
    ++kernels_;
    a.nseg = 0;
  }

  // Copy-engine copies of copies_ on `stream`: one cudaMemcpyBatchAsync, or one cudaMemcpyAsync each.
  void issue_copies(cudaStream_t stream) {
    if (copies_.empty()) return;
    for (const Copy& c : copies_) bytes_pushed_ += static_cast<int64_t>(c.bytes);
    copies_issued_ += static_cast<int64_t>(copies_.size());
#if CUDART_VERSION >= 13000
    if (batch_copies_ && copies_.size() > 1) {
      dsts_.clear();
      srcs_.clear();
      sizes_.clear();
      for (const Copy& c : copies_) {
        dsts_.push_back(reinterpret_cast<void*>(c.dst));
        srcs_.push_back(reinterpret_cast<const void*>(c.src));
        sizes_.push_back(c.bytes);
      }
      cudaMemcpyAttributes attr{};
      attr.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
      attr.flags = cudaMemcpyFlagPreferOverlapWithCompute;
      size_t attr_idx = 0;
      TIDE_CUDA("transport", cudaMemcpyBatchAsync(dsts_.data(), srcs_.data(), sizes_.data(), copies_.size(), &attr,
                                                  &attr_idx, 1, stream));
      return;
    }
#endif
    for (const Copy& c : copies_)
      TIDE_CUDA("transport", cudaMemcpyAsync(reinterpret_cast<void*>(c.dst), reinterpret_cast<const void*>(c.src), c.bytes,
                                             cudaMemcpyDefault, stream));
  }

  int64_t rank_, world_, device_, flags_off_, slots_off_, slot_bytes_, ring_off_, entry_bytes_, ctas_;
  bool batch_copies_;
  FlagLayout flags_;
  std::vector<uint64_t> bases_;
  std::vector<uint32_t> ag_uses_;
  std::vector<int64_t> rs_rounds_;
  int64_t ring_pos_ = 0;
  cudaStream_t push_ = nullptr, reduce_ = nullptr;
  cudaEvent_t ev_s_ = nullptr, ev_p_ = nullptr, ev_r_ = nullptr;
  std::vector<Copy> copies_;
  std::vector<void*> dsts_;
  std::vector<const void*> srcs_;
  std::vector<size_t> sizes_;
  int64_t copies_issued_ = 0, bytes_pushed_ = 0, kernels_ = 0, flags_posted_ = 0;
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

// Points the storage of `t` (all its views see it) at `nbytes` of device memory at `ptr`, not owned:
// the way FSDP2's resize_ gives an all-gather output its memory, but into an arena slot.
void bind_storage(const at::Tensor& t, int64_t ptr, int64_t nbytes) {
  TORCH_CHECK(t.is_cuda(), "tide.bind_storage: tensor must be on a CUDA device");
  auto* impl = t.storage().unsafeGetStorageImpl();
  impl->set_data_ptr_noswap(c10::DataPtr(reinterpret_cast<void*>(ptr), t.device()));
  impl->set_nbytes(static_cast<size_t>(nbytes));
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
                    std::vector<int64_t>, std::vector<std::vector<int64_t>>, std::vector<std::vector<int64_t>>, int64_t>())
      .def_readonly("max_rounds", &RsPlan::max_rounds)
      .def_readonly("pack_bytes", &RsPlan::pack_bytes);
  py::class_<Arena, std::shared_ptr<Arena>>(m, "Arena")
      .def(py::init<int64_t, int64_t, std::vector<int64_t>, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,
                    int64_t, int64_t, bool>())
      .def("all_gather", &Arena::all_gather)
      .def("reduce_scatter", &Arena::reduce_scatter)
      .def("bound_slot", &Arena::bound_slot)
      .def("next_slot", &Arena::next_slot)
      .def("num_slots", &Arena::num_slots)
      .def("flag_words", &Arena::flag_words)
      .def("counters", &Arena::counters);
  m.def("sum_strided", &sum_strided);
  m.def("bind_storage", &bind_storage);
  m.def("driver_available", &driver::available);
}
