// Direct NCCL point-to-point for the rails of the multi-node schedule (tide/multinode/nccl_rails.py).
//
// One step's sends and receives are one NCCL group issued from one C++ call; through torch's
// ProcessGroupNCCL every piece is a call of its own (on two H200s a 1 MiB all-gather of 8 pieces, 16
// point-to-point operations, took 0.5-0.9 ms against NCCL's 35 us all-gather). The communicator is TIDE's
// own, one per process group: torch runs its operations on its communicator from its internal stream,
// and NCCL kernels of one communicator must never run concurrently from two streams, so TIDE's share
// none of torch's. Its library is the libnccl that torch loaded, resolved with dlsym (never linked), so
// one NCCL serves the process.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

namespace tide::nccl_p2p {

// Why NCCL cannot be used here ("" when it can): no libnccl loaded in this process, or a symbol missing.
std::string unavailable();

// A fresh ncclUniqueId (its 128 bytes): rank 0 makes it, every rank of the group passes it to Comm.
std::string unique_id();

class Comm {
 public:
  // Collective over the `world` ranks that pass the same `id` (blocks until all have joined).
  Comm(const std::string& id, int64_t world, int64_t rank, int64_t device);
  ~Comm();
  Comm(const Comm&) = delete;
  Comm& operator=(const Comm&) = delete;

  // One NCCL group on `stream` (a cudaStream_t as an integer): for every i, a send of elements
  // [starts[i], starts[i] + counts[i]) of the contiguous tensor tensors[i] to peers[i] (sends[i]), or a
  // receive of them from peers[i] into that range. Both ends must post matching operations in the same
  // order (tide/multinode/rails.py pairs them). Ranges, not slices: a step has a piece per parameter, and
  // a Python slice per piece cost more host time than NCCL's whole group.
  void exchange(const std::vector<int64_t>& peers, const std::vector<at::Tensor>& tensors,
                const std::vector<int64_t>& starts, const std::vector<int64_t>& counts,
                const std::vector<bool>& sends, int64_t stream);

 private:
  void* comm_ = nullptr;
  int64_t world_, rank_, device_;
};

}  // namespace tide::nccl_p2p
