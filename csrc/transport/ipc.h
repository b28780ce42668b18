// Cross-process mappings of a leased data region (tide/transport/lease.py): the caching allocator's
// segment that holds a tensor, exported with the runtime's legacy IPC handle. torch never learns that
// the segment is shared, so freeing the lease returns its block to the allocator at once (torch's own
// sharing would park it until every consumer let go). Legacy IPC cannot export memory of
// expandable segments or of cudaMallocAsync pools: export_segment then names the error.
#pragma once

#include <torch/extension.h>

#include <string>

namespace tide::ipc {

struct Export {
  std::string handle;  // cudaIpcMemHandle_t bytes; empty on error
  int64_t offset = 0;  // of the tensor's first byte in the segment
  std::string error;   // empty on success
};

Export export_segment(const at::Tensor& t);
// Maps a peer's segment on `device`; returns its base address here.
int64_t open_segment(const std::string& handle, int64_t device);
void close_segment(int64_t base, int64_t device);

}  // namespace tide::ipc
