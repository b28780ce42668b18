// The Arena of csrc/transport/arena.h: argument checks, plan lookup and the two collectives.
#include "transport/arena.h"

#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <algorithm>
#include <cstdint>
#include <chrono>
#include <thread>

namespace tide {
namespace {

#define TIDE_CUDA(expr)                                                                                 \
  do {                                                                                                  \
    const cudaError_t err_ = (expr);                                                                    \
    TORCH_CHECK(err_ == cudaSuccess, "tide.transport: ", #expr, " failed: ", cudaGetErrorString(err_)); \
  } while (0)

// Host nanoseconds inside the ops' C++ part, by kind of call (Arena::counters).
enum HostCat { kTotal = 0, kKernel, kMemop, kCopy, kEvent };
constexpr const char* kHostNames[] = {"host_ns_total", "host_ns_kernel", "host_ns_memop", "host_ns_copy", "host_ns_event"};

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

// DType of a tensor, or -1 when the ops do not take it.
int32_t dtype_code(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return kF32;
    case at::kBFloat16: return kBF16;
    case at::kHalf: return kF16;
    default: return -1;
  }
}

uint64_t ptr_of(const at::Tensor& t) { return reinterpret_cast<uint64_t>(t.data_ptr()); }

bool float_list(const std::vector<at::Tensor>& ts, bool fp32_only) {
  for (const auto& t : ts) {
    const int32_t d = dtype_code(t.scalar_type());
    if (d < 0 || (fp32_only && d != kF32) || !t.is_contiguous()) return false;
  }
  return true;
}

void push_shape(PlanKey& key, const at::Tensor& t, int32_t dtype) {
  key.push_back(dtype);
  key.push_back(t.dim());
  for (int64_t x : t.sizes()) key.push_back(x);
}

PlanKey ag_key(const std::vector<at::Tensor>& shards, const std::vector<at::Tensor>& outs) {
  PlanKey key;
  key.reserve(4 * shards.size());
  for (size_t i = 0; i < shards.size(); ++i) push_shape(key, shards[i], dtype_code(outs[i].scalar_type()));
  return key;
}

PlanKey rs_key(const std::vector<at::Tensor>& grads) {
  PlanKey key;
  key.reserve(4 * grads.size());
  for (const auto& g : grads) push_shape(key, g, dtype_code(g.scalar_type()));
  return key;
}

}  // namespace

size_t PlanKeyHash::operator()(const PlanKey& k) const {
  uint64_t h = 1469598103934665603ull;
  for (int64_t x : k) h = (h ^ static_cast<uint64_t>(x)) * 1099511628211ull;
  return static_cast<size_t>(h);
}

const char* ran_name(Ran r) {
  switch (r) {
    case Ran::kTide: return "tide";
    case Ran::kNotBound: return "not_bound";
    case Ran::kNoPlan: return "no_plan";
    case Ran::kBadArgs: return "bad_args";
  }
  return "unknown";
}

Arena::Arena(int64_t rank, int64_t world, std::vector<int64_t> flag_bases, int64_t device, int64_t num_slots,
             int64_t slot_bytes, int64_t ring_depth, int64_t entry_bytes, int64_t sum_ctas, int64_t cast_ctas)
    : rank_(rank), world_(world), device_(device), sum_ctas_(sum_ctas), cast_ctas_(cast_ctas),
      layout_{FlagLayout{num_slots, ring_depth, world}, slot_bytes, entry_bytes} {
  TORCH_CHECK(world >= 1 && rank >= 0 && rank < world, "tide.Arena: rank ", num(rank), " not in [0, ", num(world), ")");
  TORCH_CHECK(static_cast<int64_t>(flag_bases.size()) == world, "tide.Arena: need one flag base pointer per rank");
  TORCH_CHECK(num_slots >= 0 && ring_depth >= 1, "tide.Arena: num_slots must be >= 0 and ring_depth >= 1");
  TORCH_CHECK(entry_bytes % 16 == 0 && slot_bytes % 16 == 0, "tide.Arena: entry_bytes and slot_bytes must be multiples of 16");
  TORCH_CHECK(sum_ctas >= 1 && cast_ctas >= 1, "tide.Arena: sum_ctas and cast_ctas must be >= 1");
  TORCH_CHECK(driver::available(), "tide.Arena: the CUDA driver lacks stream memory operations (cuStreamBatchMemOp)");
  for (auto b : flag_bases) flag_bases_.push_back(static_cast<uint64_t>(b));
  data_bases_.assign(world, 0);
  ag_uses_.assign(num_slots, 0);
  rs_rounds_.assign(world, 0);
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
  int lo = 0, hi = 0;
  TIDE_CUDA(cudaDeviceGetStreamPriorityRange(&lo, &hi));
  TIDE_CUDA(cudaStreamCreateWithPriority(&ag_push_, cudaStreamNonBlocking, lo));
  TIDE_CUDA(cudaStreamCreateWithPriority(&rs_push_, cudaStreamNonBlocking, lo));
  // The summing CTAs get the highest priority: scheduled ahead of the model's pending CTAs, short-lived.
  TIDE_CUDA(cudaStreamCreateWithPriority(&reduce_, cudaStreamNonBlocking, hi));
  TIDE_CUDA(cudaStreamCreateWithFlags(&report_, cudaStreamNonBlocking));
  for (auto* e : {&ev_start_, &ev_ag_push_, &ev_rs_push_, &ev_reduce_, &ev_report_})
    TIDE_CUDA(cudaEventCreateWithFlags(e, cudaEventDisableTiming));
}

Arena::~Arena() {
  // With an op still pending (a dead peer) the streams may never drain: they are left to process teardown
  // rather than waited for. Otherwise every op has joined them into its caller's stream, so they are idle.
  if (!completions::all_completed(device_)) return;
  // Streams and events are left to process teardown when the context is already gone.
  if (cudaSetDevice(static_cast<int>(device_)) != cudaSuccess) return;
  for (auto s : {ag_push_, rs_push_, reduce_, report_}) {
    cudaStreamSynchronize(s);
    cudaStreamDestroy(s);
  }
  for (auto e : {ev_start_, ev_ag_push_, ev_rs_push_, ev_reduce_, ev_report_}) cudaEventDestroy(e);
  for (auto e : ev_chunk_) cudaEventDestroy(e);
}

std::string Arena::read_flags(const at::Tensor& host, double wait_s) {
  TORCH_CHECK(host.is_pinned() && host.is_contiguous() && host.nbytes() >= static_cast<size_t>(4 * layout_.flags.words()),
              "tide.Arena.read_flags: host must be pinned and hold the flag words");
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device_));
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(wait_s);
  cudaError_t err = cudaMemcpyAsync(host.data_ptr(), reinterpret_cast<const void*>(flag_bases_[rank_]),
                                    4 * layout_.flags.words(), cudaMemcpyDeviceToHost, report_);
  if (err == cudaSuccess) err = cudaEventRecord(ev_report_, report_);
  while (err == cudaSuccess && (err = cudaEventQuery(ev_report_)) == cudaErrorNotReady) {
    if (std::chrono::steady_clock::now() > deadline) return "timeout";
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
    err = cudaSuccess;
  }
  return err == cudaSuccess ? "ok" : cudaGetErrorString(err);
}

void Arena::set_data_bases(const std::vector<int64_t>& bases) {
  TORCH_CHECK(static_cast<int64_t>(bases.size()) == world_, "tide.Arena.set_data_bases: need one base per rank");
  for (int64_t p = 0; p < world_; ++p) data_bases_[p] = static_cast<uint64_t>(bases[p]);
  if (bases[rank_] != 0) {
    std::lock_guard<std::mutex> lock(progress_mu_);
    fresh_lease_ = true;
  }
}

void Arena::sync_pushes() {
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device_));
  TIDE_CUDA(cudaStreamSynchronize(ag_push_));
  TIDE_CUDA(cudaStreamSynchronize(rs_push_));
}

void Arena::check_leased(const char* op) const {
  for (int64_t p = 0; p < world_; ++p)
    TORCH_CHECK(data_bases_[p] != 0, "tide.", op, ": the arena's data region is not leased (tide/transport/lease.py "
                "leases it before every op)");
}

void Arena::mark_completion(cudaStream_t stream) {
  const driver::MemOp write = completions::claim(device_);
  memops(stream, {write}, {});
  last_op_ = write.value;
}

// ------------------------------------------------------------------------------------ plans, checks
void Arena::add_ag_plan(const std::vector<at::Tensor>& shards, const std::vector<at::Tensor>& outs, AgPlan plan) {
  const size_t n = plan.size();
  TORCH_CHECK(n == shards.size() && n == outs.size() && plan.out_off.size() == n && plan.out_numel.size() == n &&
                  plan.out_dtype.size() == n,
              "tide.add_ag_plan: the plan does not match the shards");
  while (ev_chunk_.size() < plan.chunks.size()) {
    cudaEvent_t e = nullptr;
    TIDE_CUDA(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    ev_chunk_.push_back(e);
  }
  ag_plans_[ag_key(shards, outs)] = std::make_shared<AgPlan>(std::move(plan));
}

void Arena::add_rs_plan(const std::vector<at::Tensor>& grads, RsPlan plan) {
  TORCH_CHECK(plan.grad_dtype.size() == grads.size() && static_cast<int64_t>(plan.rounds.size()) == world_,
              "tide.add_rs_plan: the plan does not match the grads");
  plan.max_rounds = 0;
  for (const auto& per_dest : plan.rounds) plan.max_rounds = std::max<int64_t>(plan.max_rounds, per_dest.size());
  rs_plans_[rs_key(grads)] = std::make_shared<RsPlan>(std::move(plan));
}

void Arena::add_partials_plan(int64_t id, RsPlan plan) {
  TORCH_CHECK(static_cast<int64_t>(plan.rounds.size()) == world_ && plan.pads.empty(),
              "tide.add_partials_plan: need one list of rounds per rank and no padding");
  for (int32_t dt : plan.grad_dtype)
    TORCH_CHECK(dt == kF32 || dt == kBF16 || dt == kF16, "tide.add_partials_plan: gradient dtype code ", num(dt));
  auto p = std::make_shared<PartialsPlan>();
  p->grad_need.assign(plan.grad_dtype.size(), 0);
  const int64_t entry = layout_.entry_bytes;
  for (int64_t d = 0; d < world_; ++d) {
    plan.max_rounds = std::max<int64_t>(plan.max_rounds, plan.rounds[d].size());
    for (const auto& round : plan.rounds[d])
      for (const RsChunk& c : round) {
        // Every term is checked on its own first, so no sum below can overflow.
        TORCH_CHECK(c.param >= 0 && c.param < static_cast<int64_t>(p->grad_need.size()) && c.n >= 0 &&
                        c.n <= entry && c.grad_off >= 0 && c.shard_off >= 0 && c.entry_off >= 0 &&
                        c.entry_off <= entry && c.n * dtype_size(plan.grad_dtype[c.param]) <= entry - c.entry_off &&
                        c.grad_off <= INT64_MAX - c.n && c.shard_off <= INT64_MAX - c.n,
                    "tide.add_partials_plan: a chunk lies outside its gradient list or its staging entry");
        p->grad_need[c.param] = std::max(p->grad_need[c.param], c.grad_off + c.n);
        if (d == rank_) p->out_need = std::max(p->out_need, c.shard_off + c.n);
      }
  }
  p->rs = std::move(plan);
  partials_plans_[id] = std::move(p);
}

// The conditions of tide.meta.checks (which words the errors; see tide/transport/arena.py), plus every
// tensor on this arena's device.
bool Arena::ag_args_ok(const std::vector<at::Tensor>& shards, const std::vector<at::Tensor>& outs) const {
  if (shards.size() != outs.size() || !float_list(shards, false) || !float_list(outs, false)) return false;
  const at::Device dev(at::kCUDA, static_cast<c10::DeviceIndex>(device_));
  for (size_t i = 0; i < shards.size(); ++i) {
    const at::Tensor& s = shards[i];
    const at::Tensor& o = outs[i];
    if (s.device() != dev || o.device() != dev || s.dim() == 0) return false;
    std::vector<int64_t> full(s.sizes().begin(), s.sizes().end());
    full[0] *= world_;
    const bool is_flat = o.dim() == 1 && o.size(0) == world_ * s.numel();
    if (!is_flat && o.sizes().vec() != full) return false;
  }
  return true;
}

bool Arena::rs_args_ok(const std::vector<at::Tensor>& grads, const std::vector<at::Tensor>& shard_grads) const {
  if (grads.size() != shard_grads.size() || !float_list(grads, false) || !float_list(shard_grads, true)) return false;
  const at::Device dev(at::kCUDA, static_cast<c10::DeviceIndex>(device_));
  for (size_t i = 0; i < grads.size(); ++i) {
    if (grads[i].device() != dev || shard_grads[i].device() != dev) return false;
    std::vector<int64_t> want(grads[i].sizes().begin(), grads[i].sizes().end());
    if (want.empty()) want.push_back(1);  // a 0-d gradient is one row of one element
    want[0] = (want[0] + world_ - 1) / world_;
    if (shard_grads[i].sizes().vec() != want) return false;
  }
  return true;
}

int64_t Arena::bound_slot(const AgPlan& plan, const std::vector<at::Tensor>& outs) const {
  if (outs.empty() || plan.slot_bytes > layout_.slot_bytes || data_bases_[rank_] == 0) return -1;  // 0: no lease
  for (int64_t i = 0; i < layout_.flags.K; ++i) {
    const uint64_t base = slot_base(rank_, i);
    bool all = true;
    for (size_t j = 0; j < outs.size() && all; ++j)
      all = outs[j].numel() == 0 || ptr_of(outs[j]) == base + static_cast<uint64_t>(plan.out_off[j]);
    if (all) return i;
  }
  return -1;
}

// ------------------------------------------------------------------------------------ op entry points
Ran Arena::all_gather(const std::vector<at::Tensor>& shards, const std::vector<at::Tensor>& outs) {
  if (!ag_args_ok(shards, outs)) return Ran::kBadArgs;
  auto it = ag_plans_.find(ag_key(shards, outs));
  if (it == ag_plans_.end()) return Ran::kNoPlan;
  const int64_t slot = bound_slot(*it->second, outs);
  if (slot < 0) return Ran::kNotBound;
  check_leased("all_gather_into_params_");
  run_all_gather(*it->second, shards, slot);
  return Ran::kTide;
}

Ran Arena::reduce_scatter(const std::vector<at::Tensor>& grads, const std::vector<at::Tensor>& shard_grads,
                          double scale, bool accumulate) {
  if (!rs_args_ok(grads, shard_grads)) return Ran::kBadArgs;
  auto it = rs_plans_.find(rs_key(grads));
  if (it == rs_plans_.end()) return Ran::kNoPlan;
  check_leased("reduce_scatter_params_");
  run_reduce_scatter(*it->second, grads, shard_grads, static_cast<float>(scale), accumulate);
  return Ran::kTide;
}

void Arena::reduce_partials(int64_t id, const std::vector<at::Tensor>& grads, const at::Tensor& out) {
  const char* op = "reduce_scatter_params_";
  auto it = partials_plans_.find(id);
  TORCH_CHECK_VALUE(it != partials_plans_.end(), "tide.", op, ": the node arena has no partials plan ", num(id));
  const PartialsPlan& p = *it->second;
  const at::Device dev(at::kCUDA, static_cast<c10::DeviceIndex>(device_));
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
  check_leased(op);
  run_reduce_scatter(p.rs, grads, std::vector<at::Tensor>(grads.size(), out), 1.0f, false);
}

// ------------------------------------------------------------------------------------ streams, flags
void Arena::memops(cudaStream_t stream, const std::vector<driver::MemOp>& writes, const std::vector<driver::MemOp>& waits) {
  if (writes.empty() && waits.empty()) return;
  HostTimer t(host_ns_[kMemop]);
  memop_calls_ += driver::batch(stream, writes, waits);
}

void Arena::join(cudaStream_t waiter, cudaStream_t signaller, cudaEvent_t ev) {
  HostTimer t(host_ns_[kEvent]);
  TIDE_CUDA(cudaEventRecord(ev, signaller));
  TIDE_CUDA(cudaStreamWaitEvent(waiter, ev, 0));
}

void Arena::launch_cast(CastArgs& a, cudaStream_t stream) {
  if (a.nseg == 0) return;
  HostTimer t(host_ns_[kKernel]);
  launch_cast_segments(a, static_cast<int>(cast_ctas_), stream);
  ++kernels_;
  a.nseg = 0;
}

void Arena::launch_sum(SumArgs& a) {
  if (a.nseg == 0) return;
  HostTimer t(host_ns_[kKernel]);
  launch_sum_contributions(a, static_cast<int>(sum_ctas_), reduce_);
  ++kernels_;
  a.nseg = 0;
}

namespace {
cudaStream_t current_stream(int64_t device, const char* op) {
  cudaStream_t s = c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device)).stream();
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  TIDE_CUDA(cudaStreamIsCapturing(s, &status));
  TORCH_CHECK(status == cudaStreamCaptureStatusNone, "tide.", op, ": the CUDA transport cannot run while the "
              "current stream is capturing a CUDA graph (the tide ops take the stock path under capture)");
  return s;
}
}  // namespace

// ------------------------------------------------------------------------------------ TIDE-AG
void Arena::run_all_gather(const AgPlan& plan, const std::vector<at::Tensor>& shards, int64_t slot) {
  HostTimer total(host_ns_[kTotal]);
  ++ag_calls_;
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device_));
  cudaStream_t S = current_stream(device_, "all_gather_into_params_");
  {
    HostTimer t(host_ns_[kEvent]);
    TIDE_CUDA(cudaEventRecord(ev_start_, S));
  }
  const uint32_t v = open_slot(slot, ev_start_);
  const uint64_t mine = slot_base(rank_, slot);
  // Pipeline chunk c: one kernel writes its ranges of my shards into my slot i on S (cast to the output
  // dtype, or copied); the pushes read cast ranges from my slot once "chunk c" is recorded, same-dtype
  // ranges from the shard itself at once. A chunk with nothing to cast waits for nothing: its copies
  // and its kernel segments join the next batch and launch, so an AG without casts is one batch.
  CastArgs cast{};
  for (size_t c = 0; c < plan.chunks.size(); ++c) {
    bool casts = false;
    for (const ShardRange& r : plan.chunks[c]) {
      const at::Tensor& s = shards[r.param];
      const int32_t sd = dtype_code(s.scalar_type()), od = plan.out_dtype[r.param];
      const int64_t off = plan.own_off[r.param] + r.first * dtype_size(od);  // in the slot
      const auto* shard = static_cast<const char*>(s.data_ptr()) + r.first * dtype_size(sd);
      if (cast.nseg == kMaxSegments) launch_cast(cast, S);
      cast.seg[cast.nseg++] = CastSegment{shard, reinterpret_cast<void*>(mine + off), r.n, sd, od};
      casts = casts || sd != od;
      const uint64_t src = sd != od ? mine + off : reinterpret_cast<uint64_t>(shard);
      const size_t bytes = static_cast<size_t>(r.n * dtype_size(od));
      for (int64_t k = 1; k < world_; ++k) data_.add(slot_base((rank_ + k) % world_, slot) + off, src, bytes);
    }
    if (!casts && c + 1 < plan.chunks.size()) continue;
    launch_cast(cast, S);
    if (casts) join(ag_push_, S, ev_chunk_[c]);
    HostTimer t(host_ns_[kCopy]);
    data_.issue(ag_push_, false, copied_);
  }
  close_slot(slot, v, S);
}

uint32_t Arena::open_slot(int64_t slot, cudaEvent_t start) {
  const FlagLayout& f = layout_.flags;
  uint32_t v;
  {
    std::lock_guard<std::mutex> lock(progress_mu_);
    v = ++ag_uses_[slot];
    publish_locked();
  }
  {
    HostTimer t(host_ns_[kEvent]);
    TIDE_CUDA(cudaStreamWaitEvent(ag_push_, start, 0));
  }
  if (world_ > 1) {  // my slot may be written: post "free" into every peer, then wait for every peer's
    std::vector<driver::MemOp> writes, waits;
    for (int64_t k = 1; k < world_; ++k) {
      const int64_t p = (rank_ + k) % world_;
      writes.push_back(driver::MemOp{peer_flag(p, f.ag_free(slot, rank_)), v});
      waits.push_back(driver::MemOp{local_flag(f.ag_free(slot, p)), v});
    }
    writes.push_back(driver::MemOp{local_flag(f.ag_src(slot)), v});  // read by the "ready" copies
    memops(ag_push_, writes, waits);
  }
  return v;
}

void Arena::close_slot(int64_t slot, uint32_t v, cudaStream_t S) {
  const FlagLayout& f = layout_.flags;
  if (world_ > 1) {  // my pieces are in every peer's slot: post "ready", then wait for every peer's
    std::vector<driver::MemOp> waits;
    for (int64_t k = 1; k < world_; ++k) {
      const int64_t p = (rank_ + k) % world_;
      flags_.add(peer_flag(p, f.ag_ready(slot, rank_)), local_flag(f.ag_src(slot)), 4);
      waits.push_back(driver::MemOp{local_flag(f.ag_ready(slot, p)), v});
    }
    {
      HostTimer t(host_ns_[kCopy]);
      flags_.issue(ag_push_, true, copied_);
    }
    memops(S, {}, waits);
  }
  join(S, ag_push_, ev_ag_push_);
  mark_completion(S);
}

// ------------------------------------------------------------------------------------ node leg
void Arena::push_spans(int64_t slot, uint64_t start, const std::vector<uint64_t>& landed,
                       const std::vector<std::vector<int64_t>>& spans) {
  const char* op = "all_gather_into_params_";
  TORCH_CHECK_VALUE(slot >= 0 && slot < layout_.flags.K, "tide.", op, ": node arena slot ", num(slot),
                    " not in [0, ", num(layout_.flags.K), ")");
  TORCH_CHECK_VALUE(landed.size() == spans.size() && start != 0, "tide.", op,
                    ": push_spans needs a recorded start event and one event per batch of spans");
  for (size_t b = 0; b < spans.size(); ++b) {
    TORCH_CHECK_VALUE(spans[b].size() % 2 == 0 && landed[b] != 0, "tide.", op, ": batch ", num(b),
                      " needs a recorded event and (offset, bytes) pairs");
    for (size_t i = 0; i < spans[b].size(); i += 2)
      TORCH_CHECK_VALUE(spans[b][i] >= 0 && spans[b][i] <= layout_.slot_bytes && spans[b][i + 1] >= 0 &&
                            spans[b][i + 1] <= layout_.slot_bytes - spans[b][i],
                        "tide.", op, ": span of ", num(spans[b][i + 1]), " bytes at ", num(spans[b][i]), " of batch ",
                        num(b), " is not inside a slot of ", num(layout_.slot_bytes), " bytes");
  }
  check_leased(op);
  HostTimer total(host_ns_[kTotal]);
  ++ag_calls_;
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device_));
  cudaStream_t S = current_stream(device_, op);
  const uint32_t v = open_slot(slot, reinterpret_cast<cudaEvent_t>(start));
  const uint64_t mine = slot_base(rank_, slot);
  for (size_t b = 0; b < spans.size(); ++b) {
    {
      HostTimer t(host_ns_[kEvent]);
      TIDE_CUDA(cudaStreamWaitEvent(ag_push_, reinterpret_cast<cudaEvent_t>(landed[b]), 0));
    }
    for (size_t i = 0; i < spans[b].size(); i += 2)
      for (int64_t k = 1; k < world_; ++k)
        data_.add(slot_base((rank_ + k) % world_, slot) + spans[b][i], mine + spans[b][i],
                  static_cast<size_t>(spans[b][i + 1]));
    HostTimer t(host_ns_[kCopy]);
    data_.issue(ag_push_, false, copied_);
  }
  close_slot(slot, v, S);
}

// ------------------------------------------------------------------------------------ TIDE-RS
void Arena::run_reduce_scatter(const RsPlan& plan, const std::vector<at::Tensor>& grads,
                               const std::vector<at::Tensor>& shard_grads, float scale, bool accumulate) {
  HostTimer total(host_ns_[kTotal]);
  ++rs_calls_;
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device_));
  cudaStream_t S = current_stream(device_, "reduce_scatter_params_");
  const FlagLayout& f = layout_.flags;
  const int64_t R = f.R;
  // Counted (and mirrored to the issued board) before anything launches, as an all-gather's use is: a
  // launch can block behind a dead peer's flags, and the peers' reports must see this op as issued.
  std::vector<int64_t> before;  // rounds per destination before this op: its flag values build on them
  bool fresh = false;
  {
    std::lock_guard<std::mutex> lock(progress_mu_);
    if ((fresh = fresh_lease_)) {  // no permit into the old region may count for the new one (flags.h)
      for (auto& n : rs_rounds_) n += R;
      fresh_lease_ = false;
    }
    before = rs_rounds_;
    for (int64_t d = 0; d < world_; ++d) rs_rounds_[d] += static_cast<int64_t>(plan.rounds[d].size());
    publish_locked();
  }
  join(rs_push_, S, ev_start_);
  TIDE_CUDA(cudaStreamWaitEvent(reduce_, ev_start_, 0));
  // Permits go out on D, which has waited for S: after a lease, the ring is leased and this op issued.
  const int64_t my_rounds = static_cast<int64_t>(plan.rounds[rank_].size());
  std::vector<driver::MemOp> writes, waits, permits;
  auto permit = [&](uint32_t g) {
    for (int64_t k = 1; k < world_; ++k)
      permits.push_back(driver::MemOp{peer_flag((rank_ + k) % world_, f.rs_free(rank_, (g - 1) % R)), g});
  };
  if (fresh)
    for (int64_t j = 0; j < R; ++j) permit(static_cast<uint32_t>(before[rank_] + j + 1));
  SumArgs a{};
  if (!accumulate && !plan.pads.empty()) {
    a.k = 1;
    a.scale = scale;
    for (const ShardRange& p : plan.pads) {
      a.seg[a.nseg++] = SumSegment{shard_grads[p.param].data_ptr<float>() + p.first, nullptr, 0, p.n, kF32, 1};
      if (a.nseg == kMaxSegments) launch_sum(a);
    }
    launch_sum(a);
  }
  const uint64_t my_ring = data_bases_[rank_] + layout_.ring_off();
  for (int64_t j = 0; j < plan.max_rounds; ++j) {
    // My round-j pieces for every destination, rotated so that the W producers start on different peers.
    writes.clear();
    waits.clear();
    for (int64_t k = 1; k < world_; ++k) {
      const int64_t d = (rank_ + k) % world_;
      if (j >= static_cast<int64_t>(plan.rounds[d].size())) continue;
      const uint32_t g = static_cast<uint32_t>(before[d] + j + 1);
      const int64_t s = (g - 1) % R;
      waits.push_back(driver::MemOp{local_flag(f.rs_free(d, s)), g});
      writes.push_back(driver::MemOp{local_flag(f.rs_push_src(d, s)), g});
      for (const RsChunk& c : plan.rounds[d][j]) {
        const int sz = dtype_size(plan.grad_dtype[c.param]);
        data_.add(entry(d, s, rank_) + c.entry_off, ptr_of(grads[c.param]) + c.grad_off * sz, static_cast<size_t>(c.n * sz));
      }
      flags_.add(peer_flag(d, f.rs_ready(s, rank_)), local_flag(f.rs_push_src(d, s)), 4);
    }
    if (!writes.empty()) {
      memops(rs_push_, writes, waits);
      HostTimer t(host_ns_[kCopy]);
      data_.issue(rs_push_, false, copied_);
      flags_.issue(rs_push_, true, copied_);
    }
    // My own round j: post the pending permits and wait for every contributor's entry (one memop
    // batch), then sum in rank order.
    if (j >= my_rounds) continue;
    const uint32_t g = static_cast<uint32_t>(before[rank_] + j + 1);
    const int64_t s = (g - 1) % R;
    if (world_ > 1) {
      waits.clear();
      for (int64_t q = 0; q < world_; ++q)
        if (q != rank_) waits.push_back(driver::MemOp{local_flag(f.rs_ready(s, q)), g});
      memops(reduce_, permits, waits);
      permits.clear();
    }
    a = SumArgs{};
    a.staging = reinterpret_cast<const char*>(my_ring + s * world_ * layout_.entry_bytes);
    a.stride = layout_.entry_bytes;
    a.k = static_cast<int32_t>(world_);
    a.own_rank = static_cast<int32_t>(rank_);
    a.scale = scale;
    a.accumulate = accumulate;
    int32_t dtype = -1;
    for (const RsChunk& c : plan.rounds[rank_][j]) {
      const int32_t dt = plan.grad_dtype[c.param];
      if ((dtype >= 0 && dt != dtype) || a.nseg == kMaxSegments) launch_sum(a);
      dtype = dt;
      const void* own = static_cast<const char*>(grads[c.param].data_ptr()) + c.grad_off * dtype_size(dt);
      a.seg[a.nseg++] = SumSegment{shard_grads[c.param].data_ptr<float>() + c.shard_off, own, c.entry_off, c.n, dt, 0};
    }
    launch_sum(a);
    // Written by a stream memop straight into the producers' flags: the sum has read the entries when
    // the stream reaches it (a write-after-read order, so no data has to land first).
    permit(g + static_cast<uint32_t>(R));
  }
  memops(reduce_, permits, {});
  join(S, rs_push_, ev_rs_push_);
  join(S, reduce_, ev_reduce_);
  mark_completion(S);
}

std::vector<int64_t> Arena::ag_uses() const {
  std::lock_guard<std::mutex> lock(progress_mu_);
  return {ag_uses_.begin(), ag_uses_.end()};
}

std::vector<int64_t> Arena::rs_rounds() const {
  std::lock_guard<std::mutex> lock(progress_mu_);
  return rs_rounds_;
}

void Arena::publish_progress_to(uint64_t address) {
  std::lock_guard<std::mutex> lock(progress_mu_);
  published_ = reinterpret_cast<volatile uint32_t*>(address);
  publish_locked();
}

void Arena::publish_locked() {
  if (!published_) return;
  for (size_t i = 0; i < ag_uses_.size(); ++i) published_[i] = ag_uses_[i];
  for (size_t d = 0; d < rs_rounds_.size(); ++d) published_[ag_uses_.size() + d] = static_cast<uint32_t>(rs_rounds_[d]);
}

std::vector<std::pair<std::string, int64_t>> Arena::counters() const {
  std::vector<std::pair<std::string, int64_t>> c{
      {"ce_copies", copied_.copies}, {"ce_bytes", copied_.bytes}, {"flags", copied_.flags},
      {"copy_api_calls", copied_.api_calls}, {"kernels", kernels_}, {"memop_calls", memop_calls_},
      {"all_gathers", ag_calls_}, {"reduce_scatters", rs_calls_}};
  for (int i = 0; i < 5; ++i) c.emplace_back(kHostNames[i], host_ns_[i]);
  return c;
}

}  // namespace tide
