// Python bindings of the TIDE CUDA extension (tide/extension/ builds it; tide/transport/arena.py
// and the collectives' drivers use it). Arguments and plan fields are named, results are strings and
// dicts: nothing is matched by position.
#include <torch/extension.h>

#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <algorithm>
#include <atomic>
#include <optional>

#include "kernels.h"
#include "transport/arena.h"
#include "transport/collectives.h"
#include "transport/driver.h"
#include "transport/flags.h"
#include "transport/ipc.h"
#include "transport/nccl_p2p.h"
#include "transport/replays.h"

namespace tide {
namespace {

namespace py = pybind11;

// [word(0), ..., word(n - 1)] and [[word(r, 0), ...], ...] as Python lists.
template <typename Word>
py::list row(int64_t n, Word word) {
  py::list out;
  for (int64_t i = 0; i < n; ++i) out.append(word(i));
  return out;
}

template <typename Word>
py::list table(int64_t rows, int64_t cols, Word word) {
  return row(rows, [&](int64_t r) { return row(cols, [&](int64_t c) { return word(r, c); }); });
}

py::dict arena_layout(int64_t num_slots, int64_t ring_depth, int64_t world, int64_t slot_bytes, int64_t entry_bytes) {
  const ArenaLayout l{FlagLayout{num_slots, ring_depth, world}, slot_bytes, entry_bytes};
  py::dict d;
  d["flag_words"] = l.flags.words();
  d["flags_bytes"] = l.flags_bytes();
  d["slots_off"] = l.slots_off();
  d["ring_off"] = l.ring_off();
  d["data_bytes"] = l.data_bytes();
  // Every flag word's index by name (the watchdog reads a host copy of the words; the formula stays here).
  const FlagLayout& f = l.flags;
  py::dict index;
  index["ag_free"] = table(f.L(), f.W, [&](int64_t i, int64_t p) { return f.ag_free(i, p); });
  index["ag_ready"] = table(f.L(), f.W, [&](int64_t i, int64_t p) { return f.ag_ready(i, p); });
  index["ag_src"] = row(f.L(), [&](int64_t i) { return f.ag_src(i); });
  index["rs_ready"] = table(f.R, f.W, [&](int64_t s, int64_t q) { return f.rs_ready(s, q); });
  index["rs_free"] = table(f.W, f.R, [&](int64_t dst, int64_t s) { return f.rs_free(dst, s); });
  index["rs_push_src"] = table(f.W, f.R, [&](int64_t dst, int64_t s) { return f.rs_push_src(dst, s); });
  index["g_ag_free"] = table(f.L(), f.W, [&](int64_t i, int64_t p) { return f.g_ag_free(i, p); });
  index["g_ag_ready"] = table(f.L(), f.W, [&](int64_t i, int64_t p) { return f.g_ag_ready(i, p); });
  index["g_rs_ready"] = table(f.R, f.W, [&](int64_t s, int64_t q) { return f.g_rs_ready(s, q); });
  index["g_rs_free"] = table(f.W, f.R, [&](int64_t dst, int64_t s) { return f.g_rs_free(dst, s); });
  index["one"] = f.one();
  d["flag_index"] = index;
  return d;
}

// A DType per dtype (`code`: dtype_code, or gather_code for the all-gather's), refused (naming `what`)
// where the ops do not take it.
std::vector<int32_t> dtype_codes(const std::vector<at::ScalarType>& dtypes, int32_t (*code)(at::ScalarType),
                                 const char* what) {
  std::vector<int32_t> codes;
  for (at::ScalarType t : dtypes) {
    codes.push_back(code(t));
    if (code == gather_code)
      TORCH_CHECK(codes.back() >= 0, "tide.", what, ": dtypes must be fp32, bf16, fp16 or uint8");
    TORCH_CHECK(codes.back() >= 0, "tide.", what, ": dtypes must be fp32, bf16 or fp16");
  }
  return codes;
}

AgPlan make_ag_plan(std::vector<int64_t> own_offset, std::vector<int64_t> out_offset, std::vector<int64_t> out_numel,
                    const std::vector<at::ScalarType>& out_dtype, std::vector<std::vector<ShardRange>> chunks,
                    int64_t slot_bytes) {
  const size_t n = own_offset.size();
  TORCH_CHECK(out_offset.size() == n && out_numel.size() == n && out_dtype.size() == n,
              "tide.AgPlan: one own_offset, out_offset, out_numel and out_dtype per param");
  AgPlan p{std::move(own_offset), std::move(out_offset), std::move(out_numel),
           dtype_codes(out_dtype, gather_code, "AgPlan"), std::move(chunks), slot_bytes};
  for (const auto& chunk : p.chunks)
    for (const ShardRange& r : chunk)
      TORCH_CHECK(r.param >= 0 && static_cast<size_t>(r.param) < n, "tide.AgPlan: a chunk names no param");
  return p;
}

RsPlan make_rs_plan(std::vector<std::vector<std::vector<RsChunk>>> rounds, std::vector<ShardRange> pads,
                    const std::vector<at::ScalarType>& grad_dtype) {
  RsPlan p{std::move(rounds), std::move(pads), dtype_codes(grad_dtype, dtype_code, "RsPlan"), 0};
  for (const auto& per_dest : p.rounds) p.max_rounds = std::max<int64_t>(p.max_rounds, per_dest.size());
  return p;
}

py::dict counters(const Arena& a) {
  py::dict d;
  for (const auto& kv : a.counters()) d[py::str(kv.first)] = kv.second;
  return d;
}

// The summing kernel on rows of one buffer: the multi-node schedule's node partials and destination sums
// (tide/multinode/schedule.py), and the kernel's tests and benchmark. With n = the outs' numels
// summed and off_j = the numels of outs[0..j) summed:
//   outs[j] (+)= scale * (x_0 + x_1 + ... + x_{K-1})[off_j : off_j + outs[j].numel()],  fp32, k in order,
// where x_k, for k == own_row, is owns[j] read where it lies (one per out), and otherwise the next row of
// `rows` (R x n, rows contiguous: K = R + 1 with owns, K = R without, own_row = -1). Bit for bit
// tide.sums.sum_rows_reference.
void sum_rows(const std::vector<at::Tensor>& outs, const at::Tensor& rows, const std::vector<at::Tensor>& owns,
              int64_t own_row, double scale, bool accumulate, int64_t ctas) {
  auto code = [](const at::Tensor& t) {
    const int32_t c = dtype_code(t.scalar_type());
    TORCH_CHECK(c >= 0, "tide.sum_rows: rows and owns must be fp32, bf16 or fp16");
    return c;
  };
  TORCH_CHECK(!outs.empty(), "tide.sum_rows: outs is empty");
  TORCH_CHECK(rows.is_cuda() && rows.dim() == 2 && (rows.size(1) <= 1 || rows.stride(1) == 1),
              "tide.sum_rows: rows must be a 2-D CUDA tensor of contiguous rows");
  const bool has_own = !owns.empty();
  TORCH_CHECK(has_own ? owns.size() == outs.size() : own_row == -1,
              "tide.sum_rows: owns needs one tensor per out, and own_row = -1 without owns");
  const int64_t k = rows.size(0) + (has_own ? 1 : 0);
  TORCH_CHECK(k >= 1, "tide.sum_rows: no terms (rows has no row and there are no owns)");
  TORCH_CHECK(!has_own || (own_row >= 0 && own_row < k), "tide.sum_rows: own_row=", num(own_row), " not in [0, ",
              num(k), ")");
  TORCH_CHECK(ctas >= 1, "tide.sum_rows: ctas must be >= 1 (TIDE_RS_CTAS), got ", num(ctas));
  const int32_t dtype = code(rows);
  int64_t n = 0;
  for (size_t j = 0; j < outs.size(); ++j) {
    const at::Tensor& o = outs[j];
    TORCH_CHECK(o.is_cuda() && o.get_device() == rows.get_device() && o.scalar_type() == at::kFloat &&
                    o.is_contiguous(),
                "tide.sum_rows: outs[", num(j), "] must be a contiguous fp32 tensor on rows' device");
    if (has_own)
      TORCH_CHECK(owns[j].is_cuda() && owns[j].get_device() == rows.get_device() && owns[j].is_contiguous() &&
                      code(owns[j]) == dtype && owns[j].numel() == o.numel(),
                  "tide.sum_rows: owns[", num(j), "] must be contiguous, on rows' device, in rows' dtype, with outs[",
                  num(j), "]'s numel");
    n += o.numel();
  }
  TORCH_CHECK(rows.size(1) == n, "tide.sum_rows: rows have ", num(rows.size(1)), " columns, the outs ", num(n),
              " elements");
  c10::cuda::CUDAGuard guard(rows.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream().stream();
  SumArgs a{};
  a.staging = static_cast<const char*>(rows.data_ptr());
  a.stride = rows.stride(0) * static_cast<int64_t>(rows.element_size());
  a.k = static_cast<int32_t>(k);
  a.own_rank = static_cast<int32_t>(own_row);
  a.own_skipped = has_own;
  a.scale = static_cast<float>(scale);
  a.accumulate = accumulate;
  int64_t off = 0;
  for (size_t j = 0; j < outs.size(); ++j) {
    if (outs[j].numel() > 0) {
      const void* own = has_own ? owns[j].data_ptr() : nullptr;
      a.seg[a.nseg++] = SumSegment{outs[j].data_ptr<float>(), own, off * static_cast<int64_t>(rows.element_size()),
                                   outs[j].numel(), dtype, 0};
      if (a.nseg == kMaxSegments) {
        launch_sum_contributions(a, static_cast<int>(ctas), stream);
        a.nseg = 0;
      }
    }
    off += outs[j].numel();
  }
  if (a.nseg > 0) launch_sum_contributions(a, static_cast<int>(ctas), stream);
}

// The own-shard cast kernel on one contiguous pair (the kernel benchmark and tests): dst = cast(src).
void cast_into(const at::Tensor& dst, const at::Tensor& src, int64_t max_ctas) {
  auto code = [](const at::Tensor& t) {
    TORCH_CHECK(t.is_cuda() && t.is_contiguous(), "tide.cast_into: tensors must be contiguous CUDA tensors");
    const int32_t c = dtype_code(t.scalar_type());
    TORCH_CHECK(c >= 0, "tide.cast_into: dtype must be fp32, bf16 or fp16");
    return c;
  };
  TORCH_CHECK(dst.numel() == src.numel(), "tide.cast_into: dst and src differ in numel");
  c10::cuda::CUDAGuard guard(dst.device());
  CastArgs a{};
  a.nseg = 1;
  a.seg[0] = CastSegment{src.data_ptr(), dst.data_ptr(), src.numel(), code(src), code(dst)};
  launch_cast_segments(a, static_cast<int>(max_ctas), c10::cuda::getCurrentCUDAStream().stream());
}

// Points the storage of each output (all its views see it) at `nbytes[i]` of device memory at
// `base + offsets[i]` inside `region` (the leased data region): the way FSDP2's resize_ gives an
// all-gather output its memory, but into an arena slot. Each output's storage holds a reference to the
// region's storage until FSDP's reshard (resize_(0)) drops its memory, so a released lease goes back to
// the caching allocator only once no output points into it. One call per unshard. False, with nothing
// bound, unless every output is a 1-D tensor on `device` that starts its storage and has exactly
// `nbytes[i]` bytes inside `region` (the caller raises the error).
bool bind_storages(const std::vector<at::Tensor>& outs, int64_t device, const at::Tensor& region, int64_t base,
                   const std::vector<int64_t>& offsets, const std::vector<int64_t>& nbytes) {
  if (offsets.size() != outs.size() || nbytes.size() != outs.size()) return false;
  const auto lo = reinterpret_cast<int64_t>(region.data_ptr());
  const int64_t hi = lo + static_cast<int64_t>(region.nbytes());
  for (size_t i = 0; i < outs.size(); ++i) {
    const at::Tensor& t = outs[i];
    if (!t.defined() || !t.is_cuda() || t.get_device() != device || t.dim() != 1 || t.storage_offset() != 0 ||
        t.numel() * static_cast<int64_t>(t.element_size()) != nbytes[i] || base + offsets[i] < lo ||
        base + offsets[i] + nbytes[i] > hi)
      return false;
  }
  for (size_t i = 0; i < outs.size(); ++i) {
    auto* impl = outs[i].storage().unsafeGetStorageImpl();
    auto* keep = new c10::Storage(region.storage());  // dropped with this data pointer
    impl->set_data_ptr_noswap(c10::DataPtr(reinterpret_cast<void*>(base + offsets[i]), keep,
                                           [](void* ctx) { delete static_cast<c10::Storage*>(ctx); },
                                           outs[i].device()));
    impl->set_nbytes(static_cast<size_t>(nbytes[i]));
  }
  return true;
}

}  // namespace
}  // namespace tide

namespace tide {
namespace {

void bind_plans(pybind11::module_& m) {
  namespace py = pybind11;
  // Plan records: named fields, as tide/meta/plans.py names them.
  py::class_<ShardRange>(m, "ShardRange")
      .def(py::init([](int64_t param, int64_t first, int64_t numel) { return ShardRange{param, first, numel}; }),
           py::arg("param"), py::arg("first"), py::arg("numel"))
      .def_readonly("param", &ShardRange::param)
      .def_readonly("first", &ShardRange::first)
      .def_readonly("numel", &ShardRange::numel);
  py::class_<RsChunk>(m, "RsChunk")
      .def(py::init([](int64_t param, int64_t grad_offset, int64_t shard_offset, int64_t numel, int64_t entry_offset) {
             return RsChunk{param, grad_offset, shard_offset, numel, entry_offset};
           }), py::arg("param"), py::arg("grad_offset"), py::arg("shard_offset"), py::arg("numel"),
           py::arg("entry_offset"))
      .def_readonly("param", &RsChunk::param)
      .def_readonly("grad_offset", &RsChunk::grad_offset)
      .def_readonly("shard_offset", &RsChunk::shard_offset)
      .def_readonly("numel", &RsChunk::numel)
      .def_readonly("entry_offset", &RsChunk::entry_offset);
  py::class_<AgPlan, std::shared_ptr<AgPlan>>(m, "AgPlan")
      .def(py::init(&make_ag_plan), py::arg("own_offset"), py::arg("out_offset"), py::arg("out_numel"),
           py::arg("out_dtype"), py::arg("chunks"), py::arg("slot_bytes"))
      .def_readonly("out_offset", &AgPlan::out_offset)
      .def_readonly("slot_bytes", &AgPlan::slot_bytes);
  py::class_<RsPlan, std::shared_ptr<RsPlan>>(m, "RsPlan")
      .def(py::init(&make_rs_plan), py::arg("rounds"), py::arg("pads"), py::arg("grad_dtype"))
      .def_readonly("max_rounds", &RsPlan::max_rounds);
  py::class_<PartialsPlan, std::shared_ptr<PartialsPlan>>(m, "PartialsPlan");
}

// The current stream of the arena's device: the context the lease rule asks about, and the region's user.
c10::cuda::CUDAStream current_stream(const Arena& a) {
  return c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(a.device()));
}

// What a call on a layout seen before needs (arena.h), bound on the Arena class: where tensors lie, the
// lease rule, plans by call shape, the slots' busy events.
void bind_call_state(py::class_<Arena, std::shared_ptr<Arena>>& c) {
  // Where tensors lie in the held region (arena.h): the one rule the C++ kernels use too.
  c.def("slot_of", [](const Arena& a, uint64_t ptr) { return a.slot_of(ptr); }, py::arg("ptr"))
      .def("outputs_slot", [](const Arena& a, const std::vector<at::Tensor>& outs) { return a.outputs_slot(outs); },
           py::arg("outs"))
      .def("placed_slot", [](const Arena& a, const std::vector<at::Tensor>& outs, const std::vector<int64_t>& offsets,
                             int64_t need) { return a.placed_slot(outs, offsets, need); },
           py::arg("outs"), py::arg("offsets"), py::arg("need"))
      // The lease rule (Arena::held_in) for the current stream's context: tide/transport/lease.py asks it.
      .def("region_held_here", [](const Arena& a) { return a.held_in(capture_id(current_stream(a).stream())); })
      // The held region if the lease rule lets the current stream's context use it, the stream recorded as
      // one of its users; None otherwise (tide/transport/arena.py then leases, or raises the rule's error).
      .def("region_here", [](Arena& a) -> std::optional<at::Tensor> {
             const auto stream = current_stream(a);
             if (!a.held_in(capture_id(stream.stream()))) return std::nullopt;
             a.use_region_on(stream);
             return a.region();
           })
      .def("use_region_on_current_stream", [](Arena& a) { a.use_region_on(current_stream(a)); })
      // Plans by call shape: what a later call of the same shape finds without Python.
      .def("ag_plan", [](const Arena& a, const std::vector<at::Tensor>& shards, const std::vector<at::Tensor>& outs) {
             return a.ag_plan(ag_key(shards, outs));
           }, py::arg("shards"), py::arg("outs"))
      .def("keep_ag_plan", [](Arena& a, const std::vector<at::Tensor>& shards, const std::vector<at::Tensor>& outs,
                              std::shared_ptr<AgPlan> plan) { a.keep(ag_key(shards, outs), std::move(plan)); },
           py::arg("shards"), py::arg("outs"), py::arg("plan"))
      .def("rs_plan", [](Arena& a, const std::vector<at::Tensor>& grads) { return a.rs_plan(rs_key(grads)); },
           py::arg("grads"))
      .def("keep_rs_plan", [](Arena& a, const std::vector<at::Tensor>& grads, std::shared_ptr<RsPlan> plan) {
             a.keep(rs_key(grads), std::move(plan));
           }, py::arg("grads"), py::arg("plan"))
      .def("forget_plans", [](Arena& a) { a.forget_plans(); })
      // Slots' busy events (tide/transport/slots.py); `stream` is a torch stream's cuda_stream.
      .def("slot_used", [](Arena& a, int64_t slot, uint64_t stream) {
             a.slot_used(slot, reinterpret_cast<cudaStream_t>(stream));
           }, py::arg("slot"), py::arg("stream"))
      .def("slot_uses", [](Arena& a, int64_t slot) { return a.slot_uses(slot); }, py::arg("slot"));
}

void bind_arena(pybind11::module_& m) {
  namespace py = pybind11;
  // An arena's eager ops in flight, polled by the watchdog's thread (driver.h).
  py::class_<completions::InFlight, std::shared_ptr<completions::InFlight>>(m, "InFlight")
      .def("oldest", &completions::InFlight::oldest);
  py::class_<Arena, std::shared_ptr<Arena>> arena(m, "Arena");
  bind_call_state(arena);
  arena
      .def(py::init<int64_t, int64_t, std::vector<int64_t>, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,
                    int64_t>(),
           py::arg("rank"), py::arg("world"), py::arg("flag_bases"), py::arg("device"), py::arg("num_slots"),
           py::arg("slot_bytes"), py::arg("ring_depth"), py::arg("entry_bytes"), py::arg("sum_ctas"),
           py::arg("cast_ctas"))
      // The collectives (collectives.h) return (what ran, the op's id for tide.transport's watchdog:
      // driver.h); each is handed its plan, the all-gather its lane (a slot, or the direct lane: flags.h).
      .def("all_gather", [](Arena& a, const AgPlan& plan, const std::vector<at::Tensor>& shards,
                            const std::vector<at::Tensor>& outs, int64_t lane, int64_t mark) {
             const Ran ran = all_gather(a, plan, shards, outs, lane, mark);
             return std::make_pair(std::string(ran_name(ran)), a.last_op());
           }, py::arg("plan"), py::arg("shards"), py::arg("outs"), py::arg("lane"), py::arg("mark") = -1,
           py::call_guard<py::gil_scoped_release>())
      .def("reduce_scatter", [](Arena& a, const RsPlan& plan, const std::vector<at::Tensor>& grads,
                                const std::vector<at::Tensor>& shard_grads, double scale, bool accumulate,
                                int64_t mark) {
             const Ran ran = reduce_scatter(a, plan, grads, shard_grads, scale, accumulate, mark);
             return std::make_pair(std::string(ran_name(ran)), a.last_op());
           }, py::arg("plan"), py::arg("grads"), py::arg("shard_grads"), py::arg("scale"), py::arg("accumulate"),
           py::arg("mark") = -1, py::call_guard<py::gil_scoped_release>())
      .def("push_spans", [](Arena& a, int64_t slot, uint64_t start, const std::vector<uint64_t>& landed,
                            const std::vector<std::vector<int64_t>>& spans) {
             push_spans(a, slot, start, landed, spans);
             return std::make_pair(std::string(ran_name(Ran::kTide)), a.last_op());
           }, py::arg("slot"), py::arg("start"), py::arg("landed"), py::arg("spans"),
           py::call_guard<py::gil_scoped_release>())
      .def("partials_plan", [](const Arena& a, const RsPlan& plan) { return partials_plan(a, plan); }, py::arg("plan"))
      .def("reduce_partials", [](Arena& a, const PartialsPlan& plan, const std::vector<at::Tensor>& grads,
                                 const at::Tensor& out) {
             reduce_partials(a, plan, grads, out);
             return std::make_pair(std::string(ran_name(Ran::kTide)), a.last_op());
           }, py::arg("plan"), py::arg("grads"), py::arg("out"), py::call_guard<py::gil_scoped_release>())
      .def("read_flags", &Arena::read_flags, py::arg("host"), py::arg("wait_s"),
           py::call_guard<py::gil_scoped_release>())
      .def("publish_progress_to", &Arena::publish_progress_to, py::arg("address"))
      .def("set_region", [](Arena& a, std::optional<at::Tensor> region, const std::vector<int64_t>& bases,
                            uint64_t context) { a.set_region(region.value_or(at::Tensor()), bases, context); },
           py::arg("region"), py::arg("bases"), py::arg("context"))
      .def("set_direct", [](Arena& a, std::optional<at::Tensor> region, const std::vector<int64_t>& bases,
                            uint64_t context) { a.set_direct(region.value_or(at::Tensor()), bases, context); },
           py::arg("region"), py::arg("bases"), py::arg("context"))
      .def_property_readonly("in_flight", [](const Arena& a) { return a.in_flight(); })
      .def("sync_pushes", &Arena::sync_pushes, py::call_guard<py::gil_scoped_release>())
      .def("counters", &counters)
      .def("progress", [](const Arena& a) {
             py::dict d;
             d["ag_uses"] = a.ag_uses();
             d["rs_rounds"] = a.rs_rounds();
             return d;
           });
}

}  // namespace

void bind_dispatch(pybind11::module_& m);  // dispatch.cpp: the ops' CUDA kernels

}  // namespace tide

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  namespace py = pybind11;
  using namespace tide;
  m.doc() = "TIDE CUDA transport: copy-engine TIDE-AG, bounded-grid TIDE-RS, symmetric-arena flags";
  bind_plans(m);
  bind_arena(m);
  bind_dispatch(m);
  m.def("arena_layout", &arena_layout, py::arg("num_slots"), py::arg("ring_depth"), py::arg("world"),
        py::arg("slot_bytes"), py::arg("entry_bytes"));
  m.def("op_completed", &completions::completed, py::arg("device"), py::arg("op"));
  // Replay marks of captured ops (replays.h): claimed at capture, read by the watchdog.
  m.def("replay_claim", &replays::claim, py::arg("device"));
  m.def("replay_states", &replays::states, py::arg("device"), py::arg("first"), py::arg("count"));
  // The id of the CUDA-graph capture the current stream of `device` is in, 0 when it captures none: what
  // tells a lease or a slot event of one capture from another's, or from eager work.
  m.attr("EVERY_CONTEXT") = py::int_(Arena::kEveryContext);  // a symmetric region's context (arena.h)
  m.def("capture_id", [](int64_t device) {
    return capture_id(c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device)).stream());
  }, py::arg("device"));
  m.def("sum_rows", &sum_rows, py::arg("outs"), py::arg("rows"), py::arg("owns"), py::arg("own_row"), py::arg("scale"),
        py::arg("accumulate"), py::arg("ctas"));
  m.def("cast_into", &cast_into, py::arg("dst"), py::arg("src"), py::arg("max_ctas"));
  m.def("ipc_export", [](const at::Tensor& t) {
          const ipc::Export e = ipc::export_segment(t);
          return py::make_tuple(py::bytes(e.handle), e.offset, e.error);
        }, py::arg("tensor"));
  m.def("ipc_open", &ipc::open_segment, py::arg("handle"), py::arg("device"));
  m.def("ipc_close", &ipc::close_segment, py::arg("base"), py::arg("device"));
  // The multi-node rails' direct NCCL (tide/multinode/nccl_rails.py).
  m.def("nccl_unavailable", &nccl_p2p::unavailable);
  m.def("nccl_unique_id", [] { return py::bytes(nccl_p2p::unique_id()); });
  py::class_<nccl_p2p::Comm>(m, "NcclComm")
      .def(py::init<const std::string&, int64_t, int64_t, int64_t>(), py::arg("id"), py::arg("world"), py::arg("rank"),
           py::arg("device"), py::call_guard<py::gil_scoped_release>())  // blocks until every rank has joined
      .def("exchange", &nccl_p2p::Comm::exchange, py::arg("peers"), py::arg("tensors"), py::arg("starts"),
           py::arg("counts"), py::arg("sends"), py::arg("stream"),
           py::call_guard<py::gil_scoped_release>());  // may wait for peers
  // A completion word for work just issued on the current stream (driver.h): its op id.
  m.def("mark_completion", [](int64_t device) {
          c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
          const driver::MemOp write = completions::claim(device);
          driver::batch(c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device)).stream(), {write}, {});
          return write.value;
        }, py::arg("device"), py::call_guard<py::gil_scoped_release>());  // a full queue can block the launch
  // A full fence: this thread's stores before it are visible to other processes before its loads after it
  // are made (the issued board's graph-call check publishes, then reads its peers':
  // tide/transport/graph_calls.py).
  m.def("memory_fence", [] { std::atomic_thread_fence(std::memory_order_seq_cst); });
  m.def("bind_storages", &bind_storages, py::arg("outs"), py::arg("device"), py::arg("region"), py::arg("base"),
        py::arg("offsets"), py::arg("nbytes"));
}
