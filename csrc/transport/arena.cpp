// The Arena of csrc/transport/arena.h: its memory and identity, the streams, the flag handshakes and
// counters the collectives (collectives.h) share, and what a call on a layout seen before needs (the
// lease, plans by call shape, slot events).
#include "transport/arena.h"

#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGraphsC10Utils.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <algorithm>
#include <cstdint>
#include <thread>

#include "transport/driver.h"
#include "transport/replays.h"

namespace tide {
namespace {
constexpr const char* kHostNames[] = {"host_ns_total", "host_ns_kernel", "host_ns_memop", "host_ns_copy",
                                      "host_ns_event"};

void add_tensor(ShapeKey& k, const at::Tensor& t, bool sizes, bool dtype) {
  if (sizes) {
    k.push_back(t.dim());
    for (int64_t s : t.sizes()) k.push_back(s);
  }
  if (dtype) k.push_back(static_cast<int64_t>(t.scalar_type()));
}

}  // namespace

size_t ShapeKeyHash::operator()(const ShapeKey& k) const {
  size_t h = k.size();
  for (int64_t v : k) h ^= std::hash<int64_t>()(v) + 0x9e3779b97f4a7c15ULL + (h << 6) + (h >> 2);
  return h;
}

ShapeKey ag_key(at::TensorList shards, at::TensorList outs) {
  ShapeKey k;
  for (size_t i = 0; i < shards.size(); ++i) {
    add_tensor(k, shards[i], true, false);
    if (i < outs.size()) add_tensor(k, outs[i], false, true);
  }
  k.push_back(static_cast<int64_t>(shards.size()));
  return k;
}

ShapeKey rs_key(at::TensorList grads) {
  ShapeKey k;
  for (const at::Tensor& g : grads) add_tensor(k, g, true, true);
  k.push_back(static_cast<int64_t>(grads.size()));
  return k;
}

uint64_t capture_id(cudaStream_t stream) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  unsigned long long id = 0;
  TIDE_CUDA(cudaStreamGetCaptureInfo(stream, &status, &id));
  return status == cudaStreamCaptureStatusActive ? id : 0;
}

Arena::Arena(int64_t rank, int64_t world, std::vector<int64_t> flag_bases, int64_t device, int64_t num_slots,
             int64_t slot_bytes, int64_t ring_depth, int64_t entry_bytes, int64_t sum_ctas, int64_t cast_ctas)
    : rank_(rank), world_(world), device_(device), sum_ctas_(sum_ctas), cast_ctas_(cast_ctas),
      layout_{FlagLayout{num_slots, ring_depth, world}, slot_bytes, entry_bytes},
      in_flight_(std::make_shared<completions::InFlight>(device)) {
  TORCH_CHECK(world >= 1 && rank >= 0 && rank < world, "tide.Arena: rank ", num(rank), " not in [0, ", num(world), ")");
  TORCH_CHECK(static_cast<int64_t>(flag_bases.size()) == world, "tide.Arena: need one flag base pointer per rank");
  TORCH_CHECK(num_slots >= 0 && ring_depth >= 1, "tide.Arena: num_slots must be >= 0 and ring_depth >= 1");
  TORCH_CHECK(entry_bytes % 16 == 0 && slot_bytes % 16 == 0,
              "tide.Arena: entry_bytes and slot_bytes must be multiples of 16");
  TORCH_CHECK(sum_ctas >= 1 && cast_ctas >= 1, "tide.Arena: sum_ctas and cast_ctas must be >= 1");
  TORCH_CHECK(driver::available(), "tide.Arena: the CUDA driver lacks stream memory operations (cuStreamBatchMemOp)");
  for (auto b : flag_bases) flag_bases_.push_back(static_cast<uint64_t>(b));
  data_bases_.assign(world, 0);
  direct_bases_.assign(world, 0);
  ag_uses_.assign(layout_.flags.L(), 0);
  rs_rounds_.assign(world, 0);
  slots_.resize(num_slots);
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
  // rather than waited for, with the events. Otherwise every op has joined them into its caller's stream, so
  // they are idle.
  if (!completions::all_completed(device_)) return;
  // Streams and events are left to process teardown when the context is already gone.
  if (cudaSetDevice(static_cast<int>(device_)) != cudaSuccess) return;
  for (auto s : {ag_push_, rs_push_, reduce_, report_}) {
    cudaStreamSynchronize(s);
    cudaStreamDestroy(s);
  }
  for (auto e : {ev_start_, ev_ag_push_, ev_rs_push_, ev_reduce_, ev_report_}) cudaEventDestroy(e);
  for (auto e : ev_chunk_) cudaEventDestroy(e);
  for (const SlotEvent& s : slots_)
    for (cudaEvent_t e : {s.eager, s.captured})
      if (e != nullptr) cudaEventDestroy(e);
}

std::string Arena::read_flags(const at::Tensor& host, double wait_s) {
  TORCH_CHECK(host.is_pinned() && host.is_contiguous() &&
                  host.nbytes() >= static_cast<size_t>(4 * layout_.flags.words()),
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

void Arena::set_region(const at::Tensor& region, const std::vector<int64_t>& bases, uint64_t context) {
  TORCH_CHECK(static_cast<int64_t>(bases.size()) == world_, "tide.Arena.set_region: need one base per rank");
  region_ = region;
  context_ = context;
  users_.clear();
  for (int64_t p = 0; p < world_; ++p) data_bases_[p] = static_cast<uint64_t>(bases[p]);
  if (bases[rank_] != 0) {
    std::lock_guard<std::mutex> lock(progress_mu_);
    fresh_lease_ = true;
  }
}

void Arena::set_direct(const at::Tensor& region, const std::vector<int64_t>& bases, uint64_t /*context*/) {
  TORCH_CHECK(static_cast<int64_t>(bases.size()) == world_, "tide.Arena.set_direct: need one base per rank");
  for (int64_t p = 0; p < world_; ++p) direct_bases_[p] = static_cast<uint64_t>(bases[p]);
  direct_bytes_ = region.defined() ? region.numel() : 0;
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

int64_t Arena::slot_of(uint64_t ptr) const {
  if (layout_.flags.K == 0 || !region_.defined() || ptr < ptr_of(region_)) return -1;
  const int64_t off = static_cast<int64_t>(ptr - ptr_of(region_));
  if (off < layout_.slots_off() || off >= layout_.ring_off()) return -1;
  return (off - layout_.slots_off()) / layout_.slot_bytes;
}

int64_t Arena::outputs_slot(at::TensorList outs) const {
  for (const at::Tensor& o : outs)
    if (o.numel() > 0) return slot_of(ptr_of(o));
  return !outs.empty() && layout_.flags.K > 0 && region_.defined() ? 0 : -1;
}

int64_t Arena::placed_slot(at::TensorList outs, const std::vector<int64_t>& offsets, int64_t need) const {
  const int64_t slot = outputs_slot(outs);
  if (slot < 0 || offsets.size() != outs.size() || need > layout_.slot_bytes) return -1;
  const uint64_t base = ptr_of(region_) + layout_.slots_off() + slot * layout_.slot_bytes;
  for (size_t j = 0; j < outs.size(); ++j)
    if (outs[j].numel() > 0 && ptr_of(outs[j]) != base + static_cast<uint64_t>(offsets[j])) return -1;
  return slot;
}

void Arena::use_region_on(const c10::cuda::CUDAStream& stream) {
  if (!region_.defined() || std::find(users_.begin(), users_.end(), stream.stream()) != users_.end()) return;
  c10::cuda::CUDACachingAllocator::recordStream(region_.storage().data_ptr(), stream);
  users_.push_back(stream.stream());
}

std::shared_ptr<AgPlan> Arena::ag_plan(const ShapeKey& k) const {
  std::lock_guard<std::mutex> lock(plans_mu_);
  auto it = ag_plans_.find(k);
  return it == ag_plans_.end() ? nullptr : it->second;
}

std::shared_ptr<RsPlan> Arena::rs_plan(const ShapeKey& k) const {
  std::lock_guard<std::mutex> lock(plans_mu_);
  auto it = rs_plans_.find(k);
  return it == rs_plans_.end() ? nullptr : it->second;
}

void Arena::keep(const ShapeKey& k, std::shared_ptr<AgPlan> p) {
  std::lock_guard<std::mutex> lock(plans_mu_);
  ag_plans_[k] = std::move(p);
}

void Arena::keep(const ShapeKey& k, std::shared_ptr<RsPlan> p) {
  std::lock_guard<std::mutex> lock(plans_mu_);
  rs_plans_[k] = std::move(p);
}

void Arena::forget_plans() {
  std::lock_guard<std::mutex> lock(plans_mu_);
  ag_plans_.clear();
  rs_plans_.clear();
}

void Arena::slot_used(int64_t slot, cudaStream_t stream) {
  TORCH_CHECK(slot >= 0 && slot < static_cast<int64_t>(slots_.size()), "tide.slot_used: slot ", num(slot),
              " is no slot of the arena");
  SlotEvent& s = slots_[slot];
  s.context = capture_id(stream);
  cudaEvent_t& e = s.context == 0 ? s.eager : s.captured;
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device_));
  if (e == nullptr) TIDE_CUDA(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  TIDE_CUDA(cudaEventRecord(e, stream));
  ++s.uses;
}

void Arena::slot_wait(int64_t slot, cudaStream_t stream) const {
  TORCH_CHECK(slot >= 0 && slot < static_cast<int64_t>(slots_.size()), "tide.slot_wait: slot ", num(slot),
              " is no slot of the arena");
  const SlotEvent& s = slots_[slot];
  if (s.uses == 0 || s.context != capture_id(stream)) return;
  TIDE_CUDA(cudaStreamWaitEvent(stream, s.context == 0 ? s.eager : s.captured, 0));
}

WatchedOp::WatchedOp(Arena& a, const char* op, const Issue& is) : a_(a), op_before_(a.last_op()) {
  if (!is.captured()) ticket_ = a.in_flight()->begin(op);
}

WatchedOp::~WatchedOp() {
  if (ticket_ != 0) a_.in_flight()->issued(ticket_, a_.last_op() != op_before_ ? a_.last_op() : 0);
}

void Arena::start(const Issue& is) {
  if (is.captured()) memops(is.stream, {replays::begin(device_, is.mark)}, {});
}

void Arena::finish(const Issue& is) {
  if (is.captured()) {
    HostTimer t(host_ns_[kKernel]);
    replays::end(device_, is.mark, is.stream);
    return;
  }
  const driver::MemOp write = completions::claim(device_);
  memops(is.stream, {write}, {});
  last_op_ = write.value;
}

void Arena::memops(cudaStream_t stream, const std::vector<driver::MemOp>& writes,
                   const std::vector<driver::MemOp>& waits) {
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

Issue issue_on_current_stream(int64_t device, const char* op, int64_t mark) {
  cudaStream_t s = c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device)).stream();
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  TIDE_CUDA(cudaStreamIsCapturing(s, &status));
  TORCH_CHECK(status != cudaStreamCaptureStatusInvalidated, "tide.", op, ": the current stream's CUDA-graph capture "
              "was invalidated by an earlier error");
  const bool capturing = status == cudaStreamCaptureStatusActive;
  TORCH_CHECK(!capturing || mark >= 0, "tide.", op, ": the current stream is capturing a CUDA graph but the call has "
              "no replay mark (tide/transport/issue.py claims one)");
  TORCH_CHECK(capturing || mark < 0, "tide.", op, ": a replay mark was given but the current stream is not "
              "capturing a CUDA graph");
  return Issue{s, mark};
}

uint32_t Arena::open_lane(int64_t lane, cudaEvent_t start, const Issue& is) {
  const FlagLayout& f = layout_.flags;
  uint32_t v = 1;
  if (!is.captured()) {
    std::lock_guard<std::mutex> lock(progress_mu_);
    v = ++ag_uses_[lane];
    publish_locked();
  }
  {
    HostTimer t(host_ns_[kEvent]);
    TIDE_CUDA(cudaStreamWaitEvent(ag_push_, start, 0));
  }
  if (world_ > 1) {  // my lane's outputs may be written: post "free" into every peer, then wait for every peer's
    std::vector<driver::MemOp> writes, waits, resets;
    for (int64_t k = 1; k < world_; ++k) {
      const int64_t p = (rank_ + k) % world_;
      if (is.captured()) {
        writes.push_back(driver::MemOp{peer_flag(p, f.g_ag_free(lane, rank_)), 1});
        waits.push_back(driver::MemOp{local_flag(f.g_ag_free(lane, p)), 1});
        resets.push_back(driver::MemOp{local_flag(f.g_ag_free(lane, p)), 0});
      } else {
        writes.push_back(driver::MemOp{peer_flag(p, f.ag_free(lane, rank_)), v});
        waits.push_back(driver::MemOp{local_flag(f.ag_free(lane, p)), v});
      }
    }
    if (!is.captured()) writes.push_back(driver::MemOp{local_flag(f.ag_src(lane)), v});  // read by the "ready" copies
    memops(ag_push_, writes, waits);
    memops(ag_push_, resets, {});
  }
  return v;
}

void Arena::close_lane(int64_t lane, uint32_t v, const Issue& is) {
  const FlagLayout& f = layout_.flags;
  if (world_ > 1) {  // my pieces are in every peer's lane: post "ready", then wait for every peer's
    std::vector<driver::MemOp> waits, resets;
    const int64_t src = is.captured() ? f.one() : f.ag_src(lane);
    for (int64_t k = 1; k < world_; ++k) {
      const int64_t p = (rank_ + k) % world_;
      const int64_t ready_in_peer = is.captured() ? f.g_ag_ready(lane, rank_) : f.ag_ready(lane, rank_);
      const int64_t ready_here = is.captured() ? f.g_ag_ready(lane, p) : f.ag_ready(lane, p);
      flags_.add(peer_flag(p, ready_in_peer), local_flag(src), 4);
      waits.push_back(driver::MemOp{local_flag(ready_here), v});
      if (is.captured()) resets.push_back(driver::MemOp{local_flag(ready_here), 0});
    }
    issue_copies(flags_, ag_push_, true);
    memops(is.stream, {}, waits);
    memops(is.stream, resets, {});
  }
  join(is.stream, ag_push_, ev_ag_push_);
  finish(is);
}

std::vector<int64_t> Arena::count_rounds(const std::vector<int64_t>& rounds, bool& fresh) {
  std::lock_guard<std::mutex> lock(progress_mu_);
  if ((fresh = fresh_lease_)) {  // no permit into the old region may count for the new one (flags.h)
    for (auto& n : rs_rounds_) n += layout_.flags.R;
    fresh_lease_ = false;
  }
  std::vector<int64_t> before = rs_rounds_;
  for (int64_t d = 0; d < world_; ++d) rs_rounds_[d] += rounds[d];
  publish_locked();
  return before;
}

cudaEvent_t Arena::chunk_event(size_t c) {
  while (ev_chunk_.size() <= c) {
    c10::cuda::CUDAStreamCaptureModeGuard relaxed(cudaStreamCaptureModeRelaxed);  // created during a capture too
    cudaEvent_t e = nullptr;
    TIDE_CUDA(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    ev_chunk_.push_back(e);
  }
  return ev_chunk_[c];
}

void Arena::issue_copies(CopyList& list, cudaStream_t stream, bool flags) {
  HostTimer t(host_ns_[kCopy]);
  list.issue(stream, flags, copied_);
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
  for (int i = 0; i < kHostCats; ++i) c.emplace_back(kHostNames[i], host_ns_[i]);
  return c;
}

}  // namespace tide
