// The CUDA kernels of the four tide ops (tide/ops/schemas.py has the contract), registered from C++
// when the extension loads: tide/ops/cuda.py drops its Python CUDA kernels and calls hand_over_kernels
// with them. Before that (no arena yet, nothing built) those Python kernels serve CUDA calls.
//
// Every call of the two mutating ops asks the gatekeeper (gate.h) whether it may take the transport.
// On "transport", with the steady path on (handed over, no TIDE op timed out, TIDE_TRACE unset), the
// collective runs here without entering Python. Any other call enters the op's Python kernel with the
// verdict's name and what the gate found (the arena, the plan, the all-gather's slot): Python does what the
// verdict says (bind the group's name, a lease, a new plan, a capture's replay mark, the reference backend,
// an argument error) and leaves behind what the next call of that layout needs here.
// The functional ops' kernels (functional_all_gather / functional_reduce_scatter; all_gather /
// reduce_scatter are the collectives, collectives.h) allocate their outputs here and call the mutating
// kernels; arguments the functional checks would refuse go to their Python kernels, which raise.
//
// It holds the gatekeeper of gate.h too (its verdicts, in the order of its table, and the group names bound
// to arenas), beside the kernels that ask it on every call.
#include <torch/extension.h>

#include <c10/cuda/CUDAStream.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <mutex>
#include <string>
#include <type_traits>
#include <unordered_map>
#include <vector>

#include "transport/collectives.h"
#include "transport/gate.h"

namespace tide {

// ---- the gatekeeper (gate.h)
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
  *stream = c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>((*arena)->device()));
  *capture = capture_id(stream->stream());
  if ((*arena)->region().defined() && !(*arena)->held_in(*capture)) return Verdict::kLeaseAcrossCapture;
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
  g.plan = g.arena->ag_plan(ag_key(shards, outs));
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
  if (!g.arena->region().defined()) return g.verdict = Verdict::kNoLease, g;
  g.plan = g.arena->rs_plan(rs_key(grads));
  if (g.plan == nullptr) return g.verdict = Verdict::kNoPlan, g;
  if (capture != 0) g.verdict = Verdict::kCapturing;
  return g;
}

// ---- the ops' C++ CUDA kernels
namespace {

namespace py = pybind11;

enum Kernel { kAgParams = 0, kRsParams, kAg, kRs, kKernels };
constexpr std::array<const char*, kKernels> kOps = {"all_gather_into_params_", "reduce_scatter_params_", "all_gather",
                                                    "reduce_scatter"};

std::atomic<bool> steady_on{false};
std::array<std::atomic<int64_t>, 2> steady_calls{};  // calls of the two mutating ops that stayed in C++
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

// Run the collective the gate let through; "refused" when it refused the arguments.
Verdict run_all_gather(AgGate& g, at::TensorList shards, at::TensorList outs) {
  g.arena->use_region_on(g.stream);
  if (all_gather(*g.arena, *g.plan, shards, outs, g.slot, -1) != Ran::kTide) return Verdict::kRefused;
  ++steady_calls[kAgParams];
  return Verdict::kTransport;
}

Verdict run_reduce_scatter(RsGate& g, at::TensorList grads, at::TensorList shard_grads, double scale,
                           bool accumulate) {
  Arena& a = *g.arena;
  a.use_region_on(g.stream);
  if (reduce_scatter(a, *g.plan, grads, shard_grads, scale, accumulate, -1) != Ran::kTide) return Verdict::kRefused;
  // A slot that holds gradients (the Slot-Reuse hooks put them there) is busy until the stream has read them.
  std::vector<int64_t> read;
  for (const at::Tensor& grad : grads) {
    const int64_t s = grad.numel() > 0 ? a.slot_of(ptr_of(grad)) : -1;
    if (s >= 0 && std::find(read.begin(), read.end(), s) == read.end()) read.push_back(s);
  }
  for (int64_t s : read) a.slot_used(s, g.stream.stream());
  ++steady_calls[kRsParams];
  return Verdict::kTransport;
}

void all_gather_into_params(at::TensorList shards, at::TensorList outs, int64_t world, c10::string_view group) {
  AgGate g = gate_all_gather(shards, outs, world, group);
  const bool here = g.verdict == Verdict::kTransport && steady_on.load(std::memory_order_relaxed);
  if (!here || (g.verdict = run_all_gather(g, shards, outs)) != Verdict::kTransport)
    call_python<void>(kAgParams, shards.vec(), outs.vec(), world, std::string(group), verdict_name(g.verdict),
                      g.arena, g.plan, g.slot);
}

void reduce_scatter_params(at::TensorList grads, at::TensorList shard_grads, double scale, bool accumulate,
                           int64_t world, c10::string_view group) {
  RsGate g = gate_reduce_scatter(grads, shard_grads, world, group);
  const bool here = g.verdict == Verdict::kTransport && steady_on.load(std::memory_order_relaxed);
  if (!here || (g.verdict = run_reduce_scatter(g, grads, shard_grads, scale, accumulate)) != Verdict::kTransport)
    call_python<void>(kRsParams, grads.vec(), shard_grads.vec(), scale, accumulate, world, std::string(group),
                      verdict_name(g.verdict), g.arena, g.plan);
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

std::vector<at::Tensor> functional_reduce_scatter(at::TensorList inputs, double scale,
                                                  std::optional<at::ScalarType> out_dtype, int64_t world,
                                                  c10::string_view group) {
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
  m.def("bind_group", &bind_group, py::arg("group_name"), py::arg("arena"), py::arg("world_size"));
  m.def("forget_arena", &forget_arena, py::arg("arena"));
  // The gate's verdict on a call (its name, gate.h) and what it found: the arena bound to the group name and
  // the plan (None before the verdicts that find them) and, for an all-gather, the slot (-1: none). Python acts
  // on them as the kernel hands them over.
  m.def("gate_all_gather", [](const std::vector<at::Tensor>& shards, const std::vector<at::Tensor>& outs,
                              int64_t world, const std::string& group) {
    AgGate g = gate_all_gather(shards, outs, world, group);
    return py::make_tuple(verdict_name(g.verdict), g.arena, g.plan, g.slot);
  }, py::arg("shards"), py::arg("outs"), py::arg("world_size"), py::arg("group_name"));
  m.def("gate_reduce_scatter", [](const std::vector<at::Tensor>& grads, const std::vector<at::Tensor>& shard_grads,
                                  int64_t world, const std::string& group) {
    RsGate g = gate_reduce_scatter(grads, shard_grads, world, group);
    return py::make_tuple(verdict_name(g.verdict), g.arena, g.plan);
  }, py::arg("grads"), py::arg("shard_grads"), py::arg("world_size"), py::arg("group_name"));
  m.def("verdicts", [] { return std::vector<std::string>(kVerdicts.begin(), kVerdicts.end()); });
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
