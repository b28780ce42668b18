// The steady-state record of csrc/transport/steady.h.
#include "transport/steady.h"

#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>

#include <algorithm>

namespace tide {
namespace {

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

Steady::Steady(int64_t device, int64_t num_slots) : device_(device), slots_(num_slots) {}

Steady::~Steady() {
  if (cudaSetDevice(static_cast<int>(device_)) != cudaSuccess) return;  // the context is gone already
  for (const SlotEvent& s : slots_)
    for (cudaEvent_t e : {s.eager, s.captured})
      if (e != nullptr) cudaEventDestroy(e);
}

void Steady::set_region(const at::Tensor& region, uint64_t context) {
  region_ = region;
  context_ = context;
  users_.clear();
}

void Steady::use_region_on(const c10::cuda::CUDAStream& stream) {
  if (!region_.defined() || std::find(users_.begin(), users_.end(), stream.stream()) != users_.end()) return;
  c10::cuda::CUDACachingAllocator::recordStream(region_.storage().data_ptr(), stream);
  users_.push_back(stream.stream());
}

std::shared_ptr<AgPlan> Steady::ag_plan(const ShapeKey& k) const {
  std::lock_guard<std::mutex> lock(plans_mu_);
  auto it = ag_plans_.find(k);
  return it == ag_plans_.end() ? nullptr : it->second;
}

std::shared_ptr<RsPlan> Steady::rs_plan(const ShapeKey& k) const {
  std::lock_guard<std::mutex> lock(plans_mu_);
  auto it = rs_plans_.find(k);
  return it == rs_plans_.end() ? nullptr : it->second;
}

void Steady::keep(const ShapeKey& k, std::shared_ptr<AgPlan> p) {
  std::lock_guard<std::mutex> lock(plans_mu_);
  ag_plans_[k] = std::move(p);
}

void Steady::keep(const ShapeKey& k, std::shared_ptr<RsPlan> p) {
  std::lock_guard<std::mutex> lock(plans_mu_);
  rs_plans_[k] = std::move(p);
}

void Steady::forget_plans() {
  std::lock_guard<std::mutex> lock(plans_mu_);
  ag_plans_.clear();
  rs_plans_.clear();
}

void Steady::slot_used(int64_t slot, cudaStream_t stream) {
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

void Steady::slot_wait(int64_t slot, cudaStream_t stream) const {
  TORCH_CHECK(slot >= 0 && slot < static_cast<int64_t>(slots_.size()), "tide.slot_wait: slot ", num(slot),
              " is no slot of the arena");
  const SlotEvent& s = slots_[slot];
  if (s.uses == 0 || s.context != capture_id(stream)) return;
  TIDE_CUDA(cudaStreamWaitEvent(stream, s.context == 0 ? s.eager : s.captured, 0));
}

}  // namespace tide
