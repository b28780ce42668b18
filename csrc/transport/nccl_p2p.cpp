// Direct NCCL point-to-point for the multi-node rails: see nccl_p2p.h.
//
// The NCCL declarations below are the stable C ABI of nccl.h (ncclUniqueId: 128 bytes; ncclResult_t,
// ncclDataType_t: int enums, ncclUint8 = 1; ncclComm_t: a pointer), declared here so that the extension
// needs neither NCCL's headers nor its library at build time.
#include "transport/nccl_p2p.h"

#include <dlfcn.h>

#include <cstring>
#include <mutex>
#include <type_traits>

#include <c10/cuda/CUDAGuard.h>
#include <c10/util/Exception.h>
#include <cuda_runtime_api.h>

#include "kernels.h"

namespace tide::nccl_p2p {
namespace {

constexpr size_t kUniqueIdBytes = 128;
constexpr int kUint8 = 1;  // ncclUint8
struct UniqueId {
  char internal[kUniqueIdBytes];
};

struct Api {
  int (*get_unique_id)(UniqueId*) = nullptr;
  int (*comm_init_rank)(void**, int, UniqueId, int) = nullptr;
  int (*comm_abort)(void*) = nullptr;
  int (*group_start)() = nullptr;
  int (*group_end)() = nullptr;
  int (*send)(const void*, size_t, int, int, void*, cudaStream_t) = nullptr;
  int (*recv)(void*, size_t, int, int, void*, cudaStream_t) = nullptr;
  const char* (*error_string)(int) = nullptr;
  std::string missing;  // why the API is unusable; empty when every entry resolved
};

// torch's CUDA build loads libnccl.so.2 with libtorch_cuda; a build that links NCCL statically exports
// its symbols from there. Every symbol comes from the one place: the loaded libnccl.so.2 if there is one,
// else the process's global scope, so two NCCL copies are never mixed.
void* lookup(void* lib, const char* name) { return dlsym(lib ? lib : RTLD_DEFAULT, name); }

const Api& api() {
  static Api a;
  static std::once_flag once;
  std::call_once(once, [] {
    void* lib = dlopen("libnccl.so.2", RTLD_NOW | RTLD_NOLOAD);
    auto bind = [&](auto& fn, const char* name) {
      fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(lookup(lib, name));
      if (!fn && a.missing.empty()) a.missing = std::string("the process has no NCCL symbol ") + name;
    };
    bind(a.get_unique_id, "ncclGetUniqueId");
    bind(a.comm_init_rank, "ncclCommInitRank");
    bind(a.comm_abort, "ncclCommAbort");
    bind(a.group_start, "ncclGroupStart");
    bind(a.group_end, "ncclGroupEnd");
    bind(a.send, "ncclSend");
    bind(a.recv, "ncclRecv");
    bind(a.error_string, "ncclGetErrorString");
  });
  return a;
}

const Api& checked(const char* op) {
  const Api& a = api();
  const std::string& what = a.missing;
  TORCH_CHECK(what.empty(), "tide.nccl_p2p.", op, ": ", what);
  return a;
}

constexpr int kInProgress = 7;  // ncclInProgress: a non-blocking communicator (NCCL_COMM_BLOCKING=0)

void check(int result, const char* op) {
  if (result == 0) return;
  std::string what = std::string(api().error_string(result)) + " (ncclResult_t " + num(result) + ")";
  if (result == kInProgress) what += "; the direct rails need blocking communicators: unset NCCL_COMM_BLOCKING";
  TORCH_CHECK(false, "tide.nccl_p2p: ", op, " failed: ", what);
}

}  // namespace

std::string unavailable() { return api().missing; }

std::string unique_id() {
  const Api& a = checked("unique_id");
  UniqueId id{};
  check(a.get_unique_id(&id), "ncclGetUniqueId");
  return std::string(id.internal, kUniqueIdBytes);
}

Comm::Comm(const std::string& id, int64_t world, int64_t rank, int64_t device)
    : world_(world), rank_(rank), device_(device) {
  const Api& a = checked("Comm");
  TORCH_CHECK(id.size() == kUniqueIdBytes, "tide.nccl_p2p.Comm: id must be ", num(kUniqueIdBytes), " bytes, got ",
              num(static_cast<long long>(id.size())));
  TORCH_CHECK(world >= 1 && rank >= 0 && rank < world, "tide.nccl_p2p.Comm: rank ", num(rank), " out of [0, ",
              num(world), ")");
  UniqueId uid{};
  std::memcpy(uid.internal, id.data(), kUniqueIdBytes);
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
  const int result = a.comm_init_rank(&comm_, static_cast<int>(world), uid, static_cast<int>(rank));
  if (result != 0 && comm_ != nullptr) {  // a throwing constructor runs no destructor: free it here
    a.comm_abort(comm_);
    comm_ = nullptr;
  }
  check(result, "ncclCommInitRank");
}

// The registry (tide/multinode/rails.py) keeps a group's communicator for the process's life, so this runs
// at interpreter exit. ncclCommAbort, not ncclCommDestroy: destroy waits for the communicator's pending
// work, which a dead peer never lets finish.
Comm::~Comm() {
  if (comm_ != nullptr) {
    c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device_));
    api().comm_abort(comm_);  // its result is dropped: a destructor does not throw
  }
}

void Comm::exchange(const std::vector<int64_t>& peers, const std::vector<at::Tensor>& tensors,
                    const std::vector<int64_t>& starts, const std::vector<int64_t>& counts,
                    const std::vector<bool>& sends, int64_t stream) {
  const size_t n = peers.size();
  TORCH_CHECK_VALUE(tensors.size() == n && starts.size() == n && counts.size() == n && sends.size() == n,
                    "tide.nccl_p2p.exchange: peers, tensors, starts, counts and sends must have one entry per "
                    "operation");
  for (size_t i = 0; i < n; ++i) {
    const at::Tensor& t = tensors[i];
    TORCH_CHECK_VALUE(peers[i] >= 0 && peers[i] < world_ && peers[i] != rank_, "tide.nccl_p2p.exchange: operation ",
                      num(static_cast<long long>(i)), " has peer ", num(peers[i]), " (this rank ", num(rank_), " of ",
                      num(world_), ")");
    TORCH_CHECK_VALUE(t.defined() && t.is_cuda() && t.get_device() == device_ && t.is_contiguous(),
                      "tide.nccl_p2p.exchange: tensor ", num(static_cast<long long>(i)),
                      " must be a contiguous tensor on cuda:", num(device_));
    TORCH_CHECK_VALUE(starts[i] >= 0 && counts[i] >= 0 && starts[i] + counts[i] <= t.numel(),
                      "tide.nccl_p2p.exchange: operation ", num(static_cast<long long>(i)), " moves elements [",
                      num(starts[i]), ", ", num(starts[i] + counts[i]), ") of a tensor of ", num(t.numel()));
  }
  if (n == 0) return;
  const Api& a = api();
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device_));
  auto s = reinterpret_cast<cudaStream_t>(stream);
  check(a.group_start(), "ncclGroupStart");
  int result = 0;
  for (size_t i = 0; i < n && result == 0; ++i) {
    const auto item = static_cast<int64_t>(tensors[i].element_size());
    char* p = static_cast<char*>(tensors[i].data_ptr()) + starts[i] * item;
    const auto count = static_cast<size_t>(counts[i] * item);
    const int peer = static_cast<int>(peers[i]);
    result = sends[i] ? a.send(p, count, kUint8, peer, comm_, s) : a.recv(p, count, kUint8, peer, comm_, s);
  }
  const int ended = a.group_end();  // closes the group even after a failed call
  check(result, "ncclSend/ncclRecv");
  check(ended, "ncclGroupEnd");
}

}  // namespace tide::nccl_p2p
