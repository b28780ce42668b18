// What the collectives put on a stream below the kernels, in three parts:
// - stream memory ops (tide::driver): the flags' writes and waits, run in the GPU front end, not on SMs;
// - batched copies (tide::CopyList): copy-engine copies, one cudaMemcpyBatchAsync per list;
// - completion words (tide::completions): how the watchdog learns that a TIDE op completed, with no CUDA call.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <mutex>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include <cuda_runtime_api.h>

// ---- stream memory ops of the CUDA driver (flag writes and waits that run in the GPU front end, not on
// SMs), resolved at run time through cudaGetDriverEntryPointByVersion so the extension never links libcuda.
namespace tide::driver {

// One 32-bit stream memory operation: a write (*addr = value) or a wait until
// (int32_t)(*addr - value) >= 0 (wrap-around safe "greater or equal" on sequence numbers that only grow).
struct MemOp {
  uint64_t addr;
  uint32_t value;
};

// True when the driver exposes the stream memory operations (resolved once, cached).
bool available();

// The writes, then the waits, on `stream`: one cuStreamBatchMemOp where the driver takes writes and
// waits together (probed once per process), else one cuStreamWriteValue32 per write and one batch of
// waits; more calls only beyond the batch's 256-op limit. Returns the number of driver calls made.
int batch(cudaStream_t stream, const std::vector<MemOp>& writes, const std::vector<MemOp>& waits);

}  // namespace tide::driver

// ---- batched copies: copy-engine copies, issued as one cudaMemcpyBatchAsync per list (NCCL's CE
// collectives do the same); under CUDA-graph capture, as one memcpy node per copy (the batch call cannot
// be captured).
//
// Measured on 2 x H200 over NV18 (bench/ce_patterns.cu, docs/performance.md): one batch of all the
// pieces on one stream reaches 380-389 GB/s per direction from 256 MiB (a single copy: 390), while one
// cudaMemcpyAsync per piece reaches 357-371 and spreading pieces over 2-4 streams or coalescing them
// into 2-D copies gains nothing. Copies inside one batch are unordered: a flag that must follow data
// goes in a later list on the same stream.
namespace tide {

struct CopyCounters {
  int64_t copies = 0, bytes = 0, flags = 0, api_calls = 0;
};

class CopyList {
 public:
  void add(uint64_t dst, uint64_t src, size_t bytes) {
    if (bytes == 0) return;
    dst_.push_back(reinterpret_cast<void*>(dst));
    src_.push_back(reinterpret_cast<const void*>(src));
    size_.push_back(bytes);
  }
  bool empty() const { return dst_.empty(); }
  size_t size() const { return dst_.size(); }
  void clear() {
    dst_.clear();
    src_.clear();
    size_.clear();
  }
  // Issues every copy on `stream` (one call), counts them as data or as 4-B flags, and clears the list.
  void issue(cudaStream_t stream, bool flags, CopyCounters& counters);

 private:
  std::vector<void*> dst_;
  std::vector<const void*> src_;
  std::vector<size_t> size_;
};

}  // namespace tide

// ---- completion words: how the watchdog (tide/transport/watchdog.py) learns that a TIDE op has completed
// without calling into CUDA. A driver lock held by a launch that waits on a full queue (the streams
// stalled on a dead peer's flags) blocked cudaEventQuery on the GPU machine; a plain memory read cannot
// block.
//
// Per device, one ring of kWords uint32 words in pinned, mapped host memory. Op ids count up from 1 per
// device across every arena. The op's last stream operation is a memop that writes its id into word
// id % kWords; the op has completed once that word reads >= id (sequence arithmetic). A later op that
// shares the word, on another stream, would also make it read complete: that takes kWords later ops
// completing while this one is stuck. The rings are process-wide, allocated at first use and never
// freed: an op on a stalled stream may still write its word should the stream ever move.
namespace tide::completions {

constexpr uint32_t kWords = 1u << 16;

constexpr int kMaxDevices = 64;

// Zeroed uint32 words of pinned host memory mapped into a device's address space: host and device address.
struct MappedWords {
  uint32_t* host = nullptr;
  uint64_t dev = 0;
};

// One table of `n` such words per device, allocated at the device's first use (allowed during a CUDA-graph
// capture) and never freed: a stalled stream may still write into it. `what` names the owner in errors.
// The completion rings below and the replay marks (replays.h) are such tables.
class DeviceWords {
 public:
  DeviceWords(size_t n, const char* what) : n_(n), what_(what) {}
  const MappedWords& on(int64_t device);

 private:
  size_t n_;
  const char* what_;
  std::once_flag allocated_[kMaxDevices];
  MappedWords words_[kMaxDevices];
};

// The next op id of `device` and the memop that marks its completion (value = the id); the caller
// issues it last on the op's stream.
driver::MemOp claim(int64_t device);
bool completed(int64_t device, uint32_t op);
// Whether every op of `device` still in the ring's window has completed.
bool all_completed(int64_t device);

// One arena's eager ops from before each issues anything until its completion word is written: what the
// watchdog's thread polls (tide/transport/watchdog.py), with no CUDA call and without the GIL. It is
// shared with the watchdog, so that thread never keeps an arena alive. Until the issuing call returns
// an op is pending, since a launch can block on a stream whose queue is full behind a dead peer's flags.
class InFlight {
 public:
  explicit InFlight(int64_t device) : device_(device) {}
  // An op starts issuing: pending from now. Its ticket names it to issued().
  uint64_t begin(const char* op);
  // The issuing call returned: `op` is the id its completion word gets, 0 when it wrote none.
  void issued(uint64_t ticket, uint32_t op);
  // The oldest op not completed: (ticket, its name, seconds since it began, still issuing), or none.
  std::optional<std::tuple<uint64_t, std::string, double, bool>> oldest();

 private:
  struct Entry {
    uint64_t ticket;
    uint32_t op;  // 0 while issuing, or when it wrote no completion word
    bool issuing;
    std::chrono::steady_clock::time_point began;
    const char* name;
  };
  bool done(const Entry& e) const { return !e.issuing && (e.op == 0 || completed(device_, e.op)); }
  void drop_completed();  // from the front (mu_ held)

  int64_t device_;
  std::mutex mu_;
  std::deque<Entry> entries_;  // in ticket order
  uint64_t next_ = 1;
};

}  // namespace tide::completions
