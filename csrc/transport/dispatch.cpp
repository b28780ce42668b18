// The CUDA kernels of the four tide ops (tide/ops/schemas.py has the contract), registered from C++
// when the extension loads: tide/ops/cuda.py drops its Python CUDA kernels and calls hand_over_kernels
// with them. Before that (no arena yet, nothing built) those Python kernels serve CUDA calls.
//
// A call on a layout seen before runs here without entering Python. It stays in C++ when all hold:
//   - the steady path is on (handed over, no TIDE op timed out, TIDE_TRACE unset);
//   - an earlier Python call bound its group name to an arena of its world size (steady_bind_group);
//   - no argument requires grad under grad mode (the mutating ops are not differentiable);
//   - the current stream captures no CUDA graph (a captured op claims a replay mark in Python);
//   - the arena's region is held, leased eagerly (a lease is collective, and Python's);
//   - its call shape has a plan (steady.h: Python builds and agrees each one);
//   - all-gather: its outputs lie at the plan's places in one slot of the held region;
//   - the collective accepts the arguments (all_gather.cpp, reduce_scatter.cpp).
// Any other call runs the Python kernel, which takes every decision that needs Python, words every
// argument error, and fills the record a later call of that layout finds here. The functional ops'
// kernels (functional_all_gather / functional_reduce_scatter; all_gather / reduce_scatter are the
// collectives, collectives.h) allocate their outputs here and call the mutating kernels; arguments the
// functional checks would refuse go to their Python kernels, which raise.
#include <torch/extension.h>

#include <c10/cuda/CUDAStream.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <mutex>
#include <string>
#include <type_traits>
#include <unordered_map>

#include "transport/collectives.h"
#include "transport/steady.h"

namespace tide {
namespace {

namespace py = pybind11;

enum Kernel { kAgParams = 0, kRsParams, kAg, kRs, kKernels };
constexpr std::array<const char*, kKernels> kOps = {"all_gather_into_params_", "reduce_scatter_params_", "all_gather",
                                                    "reduce_scatter"};

struct Bound {
  std::weak_ptr<Arena> arena;
  int64_t world;
};

std::atomic<bool> steady_on{false};
std::array<std::atomic<int64_t>, 2> steady_calls{};  // calls of the two mutating ops that stayed in C++
std::mutex groups_mu;
std::unordered_map<std::string, Bound>& groups() {
  static auto* g = new std::unordered_map<std::string, Bound>();
  return *g;
}
// The Python kernels (tide/ops/cuda.py), kept for the process's life (never destroyed without the GIL).
std::array<py::object*, kKernels> python_kernels{};

// Python kernel `k` on these arguments, its result as R: every Python object made and dropped with the GIL held.
template <typename R, typename... Args>
R call_python(Kernel k, Args&&... args) {
  const char* op = kOps[k];
  TORCH_CHECK(python_kernels[k] != nullptr, "tide.", op, ": the extension's kernels were not handed over");
  py::gil_scoped_acquire gil;
  py::object result = (*python_kernels[k])(std::forward<Args>(args)...);
  if constexpr (!std::is_void_v<R>) return result.cast<R>();
}

std::shared_ptr<Arena> arena_for(c10::string_view group_name, int64_t world) {
  if (!steady_on.load(std::memory_order_relaxed)) return nullptr;
  std::lock_guard<std::mutex> lock(groups_mu);
  auto it = groups().find(std::string(group_name));
  if (it == groups().end() || it->second.world != world) return nullptr;
  return it->second.arena.lock();
}

bool grad_refused(at::TensorList a, at::TensorList b) {
  if (!at::GradMode::is_enabled()) return false;
  for (at::TensorList l : {a, b})
    for (const at::Tensor& t : l)
      if (t.requires_grad()) return true;
  return false;
}

// The slot of the held region that `ptr` starts in, or -1.
int64_t slot_of(const Arena& a, uint64_t ptr) {
  const at::Tensor& region = a.steady().region();
  const ArenaLayout& l = a.layout();
  const int64_t off = static_cast<int64_t>(ptr - ptr_of(region));
  if (l.flags.K == 0 || ptr < ptr_of(region) || off < l.slots_off() || off >= l.ring_off()) return -1;
  return (off - l.slots_off()) / l.slot_bytes;
}

// The held, eagerly leased region's arena and the current stream, for a call that may stay in C++.
std::shared_ptr<Arena> steady_arena(c10::string_view group, int64_t world, at::TensorList a, at::TensorList b,
                                    c10::cuda::CUDAStream* stream) {
  auto arena = arena_for(group, world);
  if (arena == nullptr || grad_refused(a, b) || !arena->steady().held_eagerly()) return nullptr;
  *stream = c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(arena->device()));
  return capture_id(stream->stream()) == 0 ? arena : nullptr;
}

bool steady_all_gather(at::TensorList shards, at::TensorList outs, int64_t world, c10::string_view group) {
  c10::cuda::CUDAStream stream = c10::cuda::getDefaultCUDAStream();
  auto a = steady_arena(group, world, shards, outs, &stream);
  if (a == nullptr) return false;
  auto plan = a->steady().ag_plan(ag_key(shards, outs));
  const at::Tensor* first = nullptr;
  for (const at::Tensor& o : outs)
    if (o.numel() > 0 && first == nullptr) first = &o;
  if (plan == nullptr || first == nullptr || plan->out_offset.size() != outs.size() ||
      plan->slot_bytes > a->layout().slot_bytes)
    return false;
  const int64_t slot = slot_of(*a, ptr_of(*first));
  if (slot < 0) return false;
  const uint64_t base = ptr_of(a->steady().region()) + a->layout().slots_off() + slot * a->layout().slot_bytes;
  for (size_t j = 0; j < outs.size(); ++j)
    if (outs[j].numel() > 0 && ptr_of(outs[j]) != base + plan->out_offset[j]) return false;
  a->steady().use_region_on(stream);
  if (all_gather(*a, *plan, shards, outs, slot, -1) != Ran::kTide) return false;
  ++steady_calls[kAgParams];
  return true;
}

bool steady_reduce_scatter(at::TensorList grads, at::TensorList shard_grads, double scale, bool accumulate,
                           int64_t world, c10::string_view group) {
  c10::cuda::CUDAStream stream = c10::cuda::getDefaultCUDAStream();
  auto a = steady_arena(group, world, grads, shard_grads, &stream);
  if (a == nullptr) return false;
  auto plan = a->steady().rs_plan(rs_key(grads));
  if (plan == nullptr) return false;
  a->steady().use_region_on(stream);
  if (reduce_scatter(*a, *plan, grads, shard_grads, scale, accumulate, -1) != Ran::kTide) return false;
  // A slot that holds gradients (the Slot-Reuse hooks put them there) is busy until the stream has read them.
  std::vector<int64_t> read;
  for (const at::Tensor& g : grads) {
    const int64_t s = g.numel() > 0 ? slot_of(*a, ptr_of(g)) : -1;
    if (s >= 0 && std::find(read.begin(), read.end(), s) == read.end()) read.push_back(s);
  }
  for (int64_t s : read) a->steady().slot_used(s, stream.stream());
  ++steady_calls[kRsParams];
  return true;
}

void all_gather_into_params(at::TensorList shards, at::TensorList outs, int64_t world, c10::string_view group) {
  if (!steady_all_gather(shards, outs, world, group))
    call_python<void>(kAgParams, shards.vec(), outs.vec(), world, std::string(group));
}

void reduce_scatter_params(at::TensorList grads, at::TensorList shard_grads, double scale, bool accumulate,
                           int64_t world, c10::string_view group) {
  if (!steady_reduce_scatter(grads, shard_grads, scale, accumulate, world, group))
    call_python<void>(kRsParams, grads.vec(), shard_grads.vec(), scale, accumulate, world, std::string(group));
}

// What the functional checks (tide.meta.checks) accept: float, contiguous tensors of at least one dim on
// one device, dim 0 a multiple of `rows_of` when given.
bool functional_ok(at::TensorList ts, int64_t world, bool whole_rows) {
  if (ts.empty() || world < 1) return false;
  for (const at::Tensor& t : ts)
    if (dtype_code(t.scalar_type()) < 0 || !t.is_contiguous() || t.dim() == 0 || t.device() != ts[0].device() ||
        (whole_rows && t.size(0) % world != 0))
      return false;
  return true;
}

std::vector<at::Tensor> functional_all_gather(at::TensorList shards, int64_t world, c10::string_view group) {
  if (!functional_ok(shards, world, false))
    return call_python<std::vector<at::Tensor>>(kAg, shards.vec(), world, std::string(group));
  std::vector<at::Tensor> ins, outs;
  for (const at::Tensor& s : shards) {
    ins.push_back(s.detach());  // below autograd: the pair's autograd is its own
    std::vector<int64_t> sizes = s.sizes().vec();
    sizes[0] *= world;
    outs.push_back(at::empty(sizes, s.options()));
  }
  all_gather_into_params(ins, outs, world, group);
  return outs;
}

std::vector<at::Tensor> functional_reduce_scatter(at::TensorList inputs, double scale, std::optional<at::ScalarType> out_dtype,
                                                  int64_t world, c10::string_view group) {
  if (!functional_ok(inputs, world, true) || (out_dtype.has_value() && dtype_code(*out_dtype) < 0))
    return call_python<std::vector<at::Tensor>>(kRs, inputs.vec(), scale, out_dtype, world, std::string(group));
  std::vector<at::Tensor> ins, shards;
  for (const at::Tensor& x : inputs) {
    ins.push_back(x.detach());
    std::vector<int64_t> sizes = x.sizes().vec();
    sizes[0] /= world;
    shards.push_back(at::empty(sizes, x.options().dtype(at::kFloat)));
  }
  reduce_scatter_params(ins, shards, scale, false, world, group);
  for (size_t i = 0; i < shards.size(); ++i) {
    const at::ScalarType want = out_dtype.value_or(inputs[i].scalar_type());
    if (want != at::kFloat) shards[i] = shards[i].to(want);
  }
  return shards;
}

void hand_over_kernels(py::object ag_params, py::object rs_params, py::object ag, py::object rs) {
  static std::once_flag once;
  std::call_once(once, [&] {
    python_kernels = {new py::object(ag_params), new py::object(rs_params), new py::object(ag), new py::object(rs)};
    static auto* lib = new torch::Library(torch::Library::IMPL, "tide", c10::DispatchKey::CUDA, __FILE__, __LINE__);
    lib->impl("all_gather_into_params_", TORCH_FN(all_gather_into_params));
    lib->impl("reduce_scatter_params_", TORCH_FN(reduce_scatter_params));
    lib->impl("all_gather", TORCH_FN(functional_all_gather));
    lib->impl("reduce_scatter", TORCH_FN(functional_reduce_scatter));
    steady_on = true;
  });
}

}  // namespace

void bind_dispatch(py::module_& m) {
  m.def("hand_over_kernels", &hand_over_kernels, py::arg("all_gather_into_params_"), py::arg("reduce_scatter_params_"),
        py::arg("all_gather"), py::arg("reduce_scatter"));
  m.def("steady_enable", [](bool on) { steady_on = on && python_kernels[0] != nullptr; }, py::arg("on"));
  m.def("steady_bind_group", [](const std::string& name, const std::shared_ptr<Arena>& a, int64_t world) {
          std::lock_guard<std::mutex> lock(groups_mu);
          groups()[name] = Bound{a, world};
        }, py::arg("group_name"), py::arg("arena"), py::arg("world_size"));
  m.def("steady_forget", [](const std::shared_ptr<Arena>& a) {
          std::lock_guard<std::mutex> lock(groups_mu);
          for (auto it = groups().begin(); it != groups().end();) {
            auto held = it->second.arena.lock();
            it = held == nullptr || held == a ? groups().erase(it) : std::next(it);
          }
        }, py::arg("arena"));
  m.def("steady_calls", [] {
    py::dict d;
    for (int k : {kAgParams, kRsParams}) d[py::str(kOps[k])] = steady_calls[k].load();
    return d;
  });
  m.def("steady_reset_calls", [] {
    for (auto& c : steady_calls) c = 0;
  });
}

}  // namespace tide
