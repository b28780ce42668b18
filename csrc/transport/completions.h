// Completion words: how the watchdog (tide/transport/watchdog.py) learns that a TIDE op has completed
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
#pragma once

#include <cstdint>

#include "transport/driver.h"

namespace tide::completions {

constexpr uint32_t kWords = 1u << 16;

// `n` zeroed uint32 words of pinned host memory mapped into `device`'s address space (never freed), and
// their device address; `what` names the caller in errors. Allowed during a CUDA-graph capture.
struct MappedWords {
  uint32_t* host;
  uint64_t dev;
};
MappedWords mapped_words(int64_t device, size_t n, const char* what);

// The next op id of `device` and the memop that marks its completion (value = the id); the caller
// issues it last on the op's stream.
driver::MemOp claim(int64_t device);
bool completed(int64_t device, uint32_t op);
// Whether every op of `device` still in the ring's window has completed.
bool all_completed(int64_t device);

}  // namespace tide::completions
